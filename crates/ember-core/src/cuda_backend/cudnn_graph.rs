//! Convolution through cuDNN's graph (backend) API: one execution plan per problem, direction
//! and thread, finalized once and run with `cudnnBackendExecute` (Note [cuDNN execution plans]).
//!
//! Note [cuDNN execution plans]: cuDNN 9's legacy convolution calls (`cudnnConvolutionForward`,
//! `...BackwardData`, `...BackwardFilter`) cost the host far more than the kernels they launch:
//! timed on an H100 host in the CNN workload's shapes, 70 to 130 µs per forward or
//! filter-gradient call and about 210 µs per input-gradient call, most of a small network's
//! step (PyTorch's convolutions, through the graph API, took 22 to 54 µs per call there, Python
//! included). Here the operation graph of one convolution, the heuristics' engine
//! configurations and the finalized execution plan are built on first use and kept in the
//! thread's plan (Note [cuDNN state] in `cudnn.rs`); a call then only makes a variant pack (the
//! three data pointers and the workspace) and executes: 23 µs per call on average there. The
//! CNN workload's eager step went from 1.16 to 0.54 ms (0.50 ms as one CUDA graph replay).
//! The first process on a fresh machine pays for loading the libraries whichever path runs:
//! `ember train`'s first epoch (its CNN, on an H100) took 1.7 to 2.9 s in that process and
//! 0.4 to 0.9 s in the next ones, with plans or with the legacy calls alike (the build that
//! ran first was the slow one each time; an earlier 2.2 against 0.5 s comparison of the two
//! paths was this order, not the plans). Leaving out engines compiled at run time changed
//! neither the first epoch nor the steady step (0.552 against 0.545 ms), so they stay in.
//!
//! Engines are filtered as PyTorch's `filterEngineConfigs` does: never one that converts its
//! inputs down, none marked nondeterministic under `deterministic`, and for float32 none on
//! tensor cores (TF32) unless `allow_tf32`. The first configuration of heuristics mode A that
//! finalizes and whose workspace can be allocated is kept; in benchmark mode the first
//! [`BENCHMARK_LIMIT`] such plans each run once on the call's own buffers, timed by events after
//! a warm-up run, and the fastest is kept (PyTorch's `benchmark_limit` is 10). Where no plan
//! is made (or the graph API refuses the problem), the caller keeps the legacy calls for it.

use crate::backend::geometry::ConvParams;
use crate::DType;
use cudarc::cudnn::sys;
use std::ffi::c_void;
use std::rc::Rc;

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;

/// Engine configurations asked of the heuristics at most.
const MAX_CONFIGS: i64 = 16;
/// Plans timed in benchmark mode at most.
pub(super) const BENCHMARK_LIMIT: usize = 10;

/// Tensor ids in the variant pack: the convolution's input, weight and output, whichever is
/// the direction's result.
const X: i64 = 1;
const W: i64 = 2;
const Y: i64 = 3;

/// A backend descriptor, destroyed when dropped.
pub(super) struct Desc(pub(super) sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // An execution plan's kernels are unloaded with it, on a thread's exit too (Note [CUPTI
        // beside other threads' CUDA work] in `cupti.rs`).
        let _gate = super::cupti::work_guard();
        // SAFETY: created by `Desc::new` and destroyed only here.
        unsafe {
            let _ = sys::cudnnBackendDestroyDescriptor(self.0);
        }
    }
}

/// The graph API's status as a result; `Err` names the call and the status. While a plan is
/// made, an error only sends the problem to the legacy calls; from [`execute`] it becomes the
/// convolution's error.
pub(super) fn ok(what: &'static str, status: sys::cudnnStatus_t) -> Result<(), String> {
    match status {
        sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        s => Err(format!("{what}: {s:?}")),
    }
}

impl Desc {
    pub(super) fn new(kind: D) -> Result<Desc, String> {
        let mut d = std::ptr::null_mut();
        // SAFETY: `d` is a valid out-pointer.
        ok("cudnnBackendCreateDescriptor", unsafe {
            sys::cudnnBackendCreateDescriptor(kind, &mut d)
        })?;
        Ok(Desc(d))
    }

    /// Sets `name` to the `n` elements of type `ty` at `values`.
    ///
    /// # Safety
    /// `values` points to `n` live elements of the C type `ty` names.
    pub(super) unsafe fn set(&self, name: A, ty: T, n: i64, values: *const c_void) -> Result<(), String> {
        // SAFETY: the descriptor is live; the caller vouches for `values`. cuDNN copies the
        // values (descriptors by handle) before returning.
        ok("cudnnBackendSetAttribute", unsafe {
            sys::cudnnBackendSetAttribute(self.0, name, ty, n, values)
        })
    }

    pub(super) fn set_i64s(&self, name: A, values: &[i64]) -> Result<(), String> {
        // SAFETY: `values` holds `len` i64s.
        unsafe {
            self.set(
                name,
                T::CUDNN_TYPE_INT64,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        }
    }

    pub(super) fn set_desc(&self, name: A, d: &Desc) -> Result<(), String> {
        // SAFETY: one descriptor handle.
        unsafe {
            self.set(
                name,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1,
                (&d.0 as *const sys::cudnnBackendDescriptor_t).cast(),
            )
        }
    }

    pub(super) fn set_handle(&self, name: A, handle: sys::cudnnHandle_t) -> Result<(), String> {
        // SAFETY: one handle.
        unsafe {
            self.set(
                name,
                T::CUDNN_TYPE_HANDLE,
                1,
                (&handle as *const sys::cudnnHandle_t).cast(),
            )
        }
    }

    pub(super) fn set_data_type(&self, name: A, dtype: sys::cudnnDataType_t) -> Result<(), String> {
        // SAFETY: one data type enum value.
        unsafe {
            self.set(
                name,
                T::CUDNN_TYPE_DATA_TYPE,
                1,
                (&dtype as *const sys::cudnnDataType_t).cast(),
            )
        }
    }

    pub(super) fn finalize(&self) -> Result<(), String> {
        // SAFETY: the descriptor is live and its required attributes were set by the caller
        // (cuDNN checks them and answers a status otherwise).
        ok("cudnnBackendFinalize", unsafe {
            sys::cudnnBackendFinalize(self.0)
        })
    }
}

/// Which of the three convolution operations a plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Forward,
    BackwardData,
    BackwardFilter,
}

/// A problem and what its plan is chosen under. The graph API reads the groups from the
/// input's channels and the weight's (`C / (C / groups)`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Problem {
    pub conv: ConvParams,
    /// The byte alignment every data pointer of the calls has (16, or the element size).
    pub alignment: i64,
    pub deterministic: bool,
    pub tf32: bool,
}

/// A finalized execution plan and the descriptors it was built from (kept alive with it).
pub(super) struct ExecPlan {
    plan: Desc,
    _config: Desc,
    _graph: Rc<Vec<Desc>>,
    /// Workspace bytes a call needs.
    pub workspace: usize,
}

fn contiguous(dims: [usize; 4]) -> ([i64; 4], [i64; 4]) {
    let d = dims.map(|v| v as i64);
    (d, [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1])
}

fn tensor(id: i64, dtype: sys::cudnnDataType_t, dims: [usize; 4], alignment: i64) -> Result<Desc, String> {
    let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    let (d, s) = contiguous(dims);
    t.set_data_type(A::CUDNN_ATTR_TENSOR_DATA_TYPE, dtype)?;
    t.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &d)?;
    t.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &s)?;
    t.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
    t.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[alignment])?;
    t.finalize()?;
    Ok(t)
}

/// Whether an engine configuration may run the problem (PyTorch's filter, module docs).
fn acceptable(config: &Desc, p: &Problem) -> Result<bool, String> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    let mut n = 0i64;
    // SAFETY: one engine descriptor handle to fill, created above; `n` is a valid out-pointer.
    ok("cudnnBackendGetAttribute(ENGINECFG_ENGINE)", unsafe {
        sys::cudnnBackendGetAttribute(
            config.0,
            A::CUDNN_ATTR_ENGINECFG_ENGINE,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            1,
            &mut n,
            (&engine.0 as *const sys::cudnnBackendDescriptor_t as *mut sys::cudnnBackendDescriptor_t).cast(),
        )
    })?;
    let mut notes = [sys::cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_TYPE_COUNT; 16];
    let mut count = 0i64;
    // SAFETY: `notes` has room for 16 values; `count` reports how many were written.
    ok("cudnnBackendGetAttribute(ENGINE_NUMERICAL_NOTE)", unsafe {
        sys::cudnnBackendGetAttribute(
            engine.0,
            A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
            T::CUDNN_TYPE_NUMERICAL_NOTE,
            notes.len() as i64,
            &mut count,
            notes.as_mut_ptr().cast(),
        )
    })?;
    use sys::cudnnBackendNumericalNote_t as N;
    let notes = &notes[..count.clamp(0, 16) as usize];
    let has = |n: N| notes.contains(&n);
    Ok(!has(N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS)
        && !(p.deterministic && has(N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC))
        && !(p.conv.dtype == DType::F32 && !p.tf32 && has(N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE)))
}

/// Builds up to `limit` execution plans of `op` on `p` for `handle`, in the heuristics' order
/// (Note [cuDNN execution plans]): none where no engine takes it; `workspace_ok` says whether
/// a workspace of so many bytes can be had (a plan that needs more gives way to the next one).
pub(super) fn plans(
    handle: sys::cudnnHandle_t,
    op: Op,
    p: &Problem,
    limit: usize,
    mut workspace_ok: impl FnMut(usize) -> bool,
) -> Result<Vec<ExecPlan>, String> {
    let output = p
        .conv
        .output()
        .ok_or("the kernel does not fit the padded input")?;
    let dt = super::cudnn::data_type(p.conv.dtype);
    let (compute, double) = match p.conv.dtype {
        DType::F64 => (sys::cudnnDataType_t::CUDNN_DATA_DOUBLE, true),
        _ => (sys::cudnnDataType_t::CUDNN_DATA_FLOAT, false),
    };
    let (x, w, y) = (
        tensor(X, dt, p.conv.input, p.alignment)?,
        tensor(W, dt, p.conv.weight, p.alignment)?,
        tensor(Y, dt, output, p.alignment)?,
    );
    let conv = Desc::new(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.set_data_type(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, compute)?;
    let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
    // SAFETY: one convolution mode value.
    unsafe {
        conv.set(
            A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            T::CUDNN_TYPE_CONVOLUTION_MODE,
            1,
            (&mode as *const sys::cudnnConvolutionMode_t).cast(),
        )?
    };
    let two = |v: [usize; 2]| v.map(|e| e as i64);
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &two(p.conv.dilation))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &two(p.conv.stride))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &two(p.conv.padding))?;
    conv.set_i64s(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &two(p.conv.padding))?;
    conv.finalize()?;

    let (kind, [a_x, a_w, a_y, a_conv, a_alpha, a_beta]) = match op {
        Op::Forward => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
        ),
        Op::BackwardData => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
        ),
        Op::BackwardFilter => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
        ),
    };
    let operation = Desc::new(kind)?;
    operation.set_desc(a_x, &x)?;
    operation.set_desc(a_w, &w)?;
    operation.set_desc(a_y, &y)?;
    operation.set_desc(a_conv, &conv)?;
    let (one, zero) = (1.0f64, 0.0f64);
    let (one32, zero32) = (1.0f32, 0.0f32);
    // SAFETY: one scalar each, of the compute type's width (double for f64 problems).
    unsafe {
        if double {
            operation.set(a_alpha, T::CUDNN_TYPE_DOUBLE, 1, (&one as *const f64).cast())?;
            operation.set(a_beta, T::CUDNN_TYPE_DOUBLE, 1, (&zero as *const f64).cast())?;
        } else {
            operation.set(a_alpha, T::CUDNN_TYPE_FLOAT, 1, (&one32 as *const f32).cast())?;
            operation.set(a_beta, T::CUDNN_TYPE_FLOAT, 1, (&zero32 as *const f32).cast())?;
        }
    }
    operation.finalize()?;

    let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set_desc(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &operation)?;
    graph.set_handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
    graph.finalize()?;

    let (heur, configs) = engine_configs(&graph, sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A)?;
    let shared = Rc::new(vec![x, w, y, conv, operation, graph, heur]);
    let mut made = Vec::new();
    for config in configs {
        if made.len() == limit {
            break;
        }
        if !acceptable(&config, p)? {
            continue;
        }
        let Some((plan, workspace)) = finalized_plan(handle, &config)? else {
            continue; // this engine cannot run the problem after all: the next one
        };
        if !workspace_ok(workspace) {
            continue;
        }
        made.push(ExecPlan {
            plan,
            _config: config,
            _graph: shared.clone(),
            workspace,
        });
    }
    Ok(made)
}

/// The engine configurations the heuristics in `mode` give for the finalized operation graph
/// `graph`, best first, at most [`MAX_CONFIGS`], with the heuristics descriptor they came from
/// (kept alive beside the plans made from them).
pub(super) fn engine_configs(
    graph: &Desc,
    mode: sys::cudnnBackendHeurMode_t,
) -> Result<(Desc, Vec<Desc>), String> {
    let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)?;
    // SAFETY: one heuristics mode value.
    unsafe {
        heur.set(
            A::CUDNN_ATTR_ENGINEHEUR_MODE,
            T::CUDNN_TYPE_HEUR_MODE,
            1,
            (&mode as *const sys::cudnnBackendHeurMode_t).cast(),
        )?
    };
    heur.finalize()?;
    let mut configs = (0..MAX_CONFIGS)
        .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    let mut handles: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let mut found = 0i64;
    // SAFETY: `handles` holds MAX_CONFIGS engine configuration descriptors created above for
    // cuDNN to fill; `found` reports how many it filled.
    ok("cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)", unsafe {
        sys::cudnnBackendGetAttribute(
            heur.0,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            MAX_CONFIGS,
            &mut found,
            handles.as_mut_ptr().cast(),
        )
    })?;
    configs.truncate(found.clamp(0, MAX_CONFIGS) as usize);
    Ok((heur, configs))
}

/// The execution plan of `config` for `handle` and the workspace bytes it needs; None where
/// the engine cannot run the problem after all (its plan does not finalize).
pub(super) fn finalized_plan(
    handle: sys::cudnnHandle_t,
    config: &Desc,
) -> Result<Option<(Desc, usize)>, String> {
    let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set_handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
    plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
    if plan.finalize().is_err() {
        return Ok(None);
    }
    let (mut bytes, mut n) = (0i64, 0i64);
    // SAFETY: one i64 to fill; `n` is a valid out-pointer.
    ok(
        "cudnnBackendGetAttribute(EXECUTION_PLAN_WORKSPACE_SIZE)",
        unsafe {
            sys::cudnnBackendGetAttribute(
                plan.0,
                A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                T::CUDNN_TYPE_INT64,
                1,
                &mut n,
                (&mut bytes as *mut i64).cast(),
            )
        },
    )?;
    Ok(Some((plan, bytes.max(0) as usize)))
}

/// Runs `plan` with `handle` (bound to the stream to run on) on the device buffers `x`, `w`,
/// `y` (the convolution's input, weight and output, whichever the direction writes) and
/// `workspace` (at least `plan.workspace` bytes, or 0 when it needs none).
///
/// # Safety
/// The buffers hold the problem's shapes in its dtype, aligned as the plan's problem said, and
/// stay valid until the work queued on the handle's stream has run; `handle` is the one the
/// plan was built for and no other thread uses it.
pub(super) unsafe fn execute(
    handle: sys::cudnnHandle_t,
    plan: &ExecPlan,
    x: u64,
    w: u64,
    y: u64,
    workspace: u64,
) -> Result<(), String> {
    let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    let ids = [X, W, Y];
    let ptrs: [*mut c_void; 3] = [x as *mut c_void, w as *mut c_void, y as *mut c_void];
    let ws = workspace as *mut c_void;
    // SAFETY: three ids and three pointers; one workspace pointer (may be null when the plan
    // needs none).
    unsafe {
        pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &ids)?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            T::CUDNN_TYPE_VOID_PTR,
            3,
            ptrs.as_ptr().cast(),
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            1,
            (&ws as *const *mut c_void).cast(),
        )?;
    }
    pack.finalize()?;
    // SAFETY: the caller's contract (buffers, handle); the plan and pack are finalized.
    ok("cudnnBackendExecute", unsafe {
        sys::cudnnBackendExecute(handle, plan.plan.0, pack.0)
    })
}
