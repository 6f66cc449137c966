//! Fused attention through cuDNN's graph API: the forward and backward operation graphs that
//! cuDNN's fused flash-attention engines recognize, built once per problem and thread and run
//! with `cudnnBackendExecute` (Note [cuDNN execution plans] in `cudnn_graph.rs`).
//!
//! Note [cuDNN attention graphs]: cuDNN 9 has no single attention operation on Hopper (its
//! unified SDPA node needs 9.13.1 and Blackwell, and takes no causal mask before 9.21); its
//! fused attention engines match a graph of elementary operations instead, the graph that
//! cuDNN's C++ frontend (`scaled_dot_product_flash_attention.h`, `SDPANode` and
//! `SDPABackwardNode`) lowers `sdpa` to. These functions build the same graph, node for node:
//! - forward: `S = Q·Kᵀ` (float), `S·scale`, the causal mask (row and column indices,
//!   `row >= col`, a select of the lowest float elsewhere), softmax with statistics (max,
//!   subtract, exp, sum, `stats = max + log(sum)` written, divide), the weights in the input
//!   dtype, `O = P·V`;
//! - backward: `Σ dO∘O` per row (written, float), `S` again as forward up to the mask,
//!   `P = exp(S - stats)`, `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP - Σ)·scale`, `dK = dSᵀ·Q`,
//!   `dQ = dS·K` accumulated in float (written) and converted.
//! K and V enter as their transposes (dims 2 and 3 swapped, strides with them), as the backend
//! expects. The two float buffers of the backward (row sums and the dQ accumulator) come from
//! the caching allocator per call. cuDNN before 9.6 asked the caller to zero the accumulator;
//! from 9.6 the engine clears it itself (the frontend's `SDPABackwardNode` stopped its memset
//! there), so it is zeroed only under older libraries: 6.5 µs of `sdpa_causal_bf16`'s step on
//! an H200 (docs/benchmarks.md, session 49). `cudnn_attention_backward_needs_no_zeroed_scratch`
//! runs the backward on scratch that held NaN.
//!
//! Which problems: bf16 and f16, head dims up to 128 (multiples of 8), no mask or the causal
//! one, no dropout, equal heads for query, key and value; 16-byte aligned pointers and strides
//! that are multiples of 8 elements. Anything else, or a graph no engine takes, answers `None`
//! and the op layer computes attention from its parts (PyTorch's math backend).
//!
//! Speed (`docs/benchmarks.md`, sessions 43, 44 and 49, one H200): `sdpa_causal_bf16` (forward
//! and backward, [8, 12, 1024, 64]) took 0.485 ms against PyTorch's 0.251 ms while the output
//! gradient was copied to this layout and every input gradient copied out of it; with Note
//! [Attention gradients in place] (`ops/attention.rs`) 0.253 ms against 0.237.
//!
//! Note [No faster attention engine]: PyTorch (with its wheel's cuDNN 9.19) runs this problem on the same
//! cuDNN kernels: its profile shows the backward `..._bprop_wgmma_f16_knob_26_64x64x64` (119
//! µs), the forward `..._fprop_..._knob_7_64x128x64` (46 µs), cuDNN's `dO·O` (13.4 µs) and dQ
//! conversion (11.6 µs), and three gradient accumulations (29.5 µs). Every engine
//! configuration cuDNN offers was timed through its frontend (heuristics A, B and fallback,
//! and every value of the kernel-configuration knob): the forward's best is 47.4 µs (this
//! graph's heuristic takes `knob_32`, 48 µs), the backward's only fast one is knob 26 (149
//! µs with its `dO·O` and conversion); the rest take 87–440 µs. So ember and PyTorch share a
//! floor of ~0.197 ms of attention kernels, and the 1.2× PyTorch (≤ 0.196 ms against
//! its 0.235) would need kernels faster than cuDNN's own and free gradient accumulation.

use super::cudnn::{self, with_handle};
use super::cudnn_graph::{engine_configs, finalized_plan, ok, Desc};
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::geometry::{bshd_strides, SdpaGrads, SdpaParams};
use crate::backend::AttentionOps;
use crate::{DType, Error, Result};
use cudarc::cudnn::sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::rc::Rc;

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;
use sys::cudnnDataType_t as Dt;
use sys::cudnnPointwiseMode_t as Pw;

/// Unique ids of the tensors a call passes (the virtual ones count up from [`FIRST_VIRTUAL`]).
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const SCALE: i64 = 6;
    pub const LOWEST: i64 = 7;
    pub const ONE: i64 = 8;
    pub const D_O: i64 = 9;
    pub const D_Q: i64 = 10;
    pub const D_K: i64 = 11;
    pub const D_V: i64 = 12;
    pub const ROW_SUM: i64 = 13;
    pub const DQ_ACCUM: i64 = 14;
}
const FIRST_VIRTUAL: i64 = 100;
/// The first cuDNN whose attention backward clears its own dQ accumulator (module note).
const ENGINE_ZEROES_DQ_ACCUM: usize = 90600;

/// A graph under construction: every descriptor made for it (kept alive with the plan) and
/// its operations in order.
struct Graph {
    descs: Vec<Desc>,
    ops: Vec<usize>,
    next_virtual: i64,
}

/// A tensor of the graph: its descriptor's index.
#[derive(Clone, Copy)]
struct Tn(usize);

fn contiguous(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

impl Graph {
    fn new() -> Graph {
        Graph {
            descs: Vec::new(),
            ops: Vec::new(),
            next_virtual: FIRST_VIRTUAL,
        }
    }

    fn keep(&mut self, d: Desc) -> usize {
        self.descs.push(d);
        self.descs.len() - 1
    }

    fn make_tensor(
        &mut self,
        id: i64,
        dtype: Dt,
        dims: [i64; 4],
        strides: [i64; 4],
        is_virtual: bool,
        by_value: bool,
    ) -> Result<Tn, String> {
        let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        t.set_data_type(A::CUDNN_ATTR_TENSOR_DATA_TYPE, dtype)?;
        t.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        t.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        t.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
        t.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
        for (on, name) in [
            (is_virtual, A::CUDNN_ATTR_TENSOR_IS_VIRTUAL),
            (by_value, A::CUDNN_ATTR_TENSOR_IS_BY_VALUE),
        ] {
            if on {
                let yes = true;
                // SAFETY: one C bool.
                unsafe { t.set(name, T::CUDNN_TYPE_BOOLEAN, 1, (&yes as *const bool).cast())? };
            }
        }
        t.finalize()?;
        Ok(Tn(self.keep(t)))
    }

    /// A tensor the call passes a buffer for.
    fn io(&mut self, id: i64, dtype: Dt, dims: [i64; 4], strides: [i64; 4]) -> Result<Tn, String> {
        self.make_tensor(id, dtype, dims, strides, false, false)
    }

    /// An intermediate that never leaves the fused kernel (row-major).
    fn virt(&mut self, dtype: Dt, dims: [i64; 4]) -> Result<Tn, String> {
        self.virt_strided(dtype, dims, contiguous(dims))
    }

    fn virt_strided(&mut self, dtype: Dt, dims: [i64; 4], strides: [i64; 4]) -> Result<Tn, String> {
        let id = self.next_virtual;
        self.next_virtual += 1;
        self.make_tensor(id, dtype, dims, strides, true, false)
    }

    /// A float scalar passed by value at each call.
    fn scalar(&mut self, id: i64) -> Result<Tn, String> {
        self.make_tensor(id, Dt::CUDNN_DATA_FLOAT, [1; 4], [1; 4], false, true)
    }

    fn op(&mut self, d: Desc) -> Result<(), String> {
        d.finalize()?;
        let i = self.keep(d);
        self.ops.push(i);
        Ok(())
    }

    /// `y = mode(x[, b[, t]])`; `axis` for GEN_INDEX; `math` the compute type.
    fn pointwise(
        &mut self,
        mode: Pw,
        math: Dt,
        axis: Option<i64>,
        x: Tn,
        b: Option<Tn>,
        t: Option<Tn>,
        y: Tn,
    ) -> Result<(), String> {
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        // SAFETY: one pointwise mode value.
        unsafe {
            pw.set(
                A::CUDNN_ATTR_POINTWISE_MODE,
                T::CUDNN_TYPE_POINTWISE_MODE,
                1,
                (&mode as *const Pw).cast(),
            )?
        };
        pw.set_data_type(A::CUDNN_ATTR_POINTWISE_MATH_PREC, math)?;
        if let Some(axis) = axis {
            pw.set_i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
        }
        pw.finalize()?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &pw)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &self.descs[x.0])?;
        if let Some(b) = b {
            op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &self.descs[b.0])?;
        }
        if let Some(t) = t {
            op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &self.descs[t.0])?;
        }
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &self.descs[y.0])?;
        let one = 1.0f32;
        // SAFETY: one float each.
        unsafe {
            op.set(
                A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
                T::CUDNN_TYPE_FLOAT,
                1,
                (&one as *const f32).cast(),
            )?;
            op.set(
                A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
                T::CUDNN_TYPE_FLOAT,
                1,
                (&one as *const f32).cast(),
            )?;
        }
        self.keep(pw);
        self.op(op)
    }

    /// A float pointwise op into a new virtual float tensor of `dims`.
    fn float_op(&mut self, mode: Pw, x: Tn, b: Option<Tn>, dims: [i64; 4]) -> Result<Tn, String> {
        let y = self.virt(Dt::CUDNN_DATA_FLOAT, dims)?;
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, None, x, b, None, y)?;
        Ok(y)
    }

    fn reduction(&mut self, add: bool, x: Tn, y: Tn) -> Result<(), String> {
        let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        let mode = if add {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD
        } else {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX
        };
        // SAFETY: one reduction operator value.
        unsafe {
            r.set(
                A::CUDNN_ATTR_REDUCTION_OPERATOR,
                T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
                1,
                (&mode as *const sys::cudnnReduceTensorOp_t).cast(),
            )?
        };
        r.set_data_type(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        r.finalize()?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &r)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &self.descs[x.0])?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &self.descs[y.0])?;
        self.keep(r);
        self.op(op)
    }

    fn matmul(&mut self, a: Tn, b: Tn, c: Tn) -> Result<(), String> {
        let m = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        m.set_data_type(A::CUDNN_ATTR_MATMUL_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        m.finalize()?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &self.descs[a.0])?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &self.descs[b.0])?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &self.descs[c.0])?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &m)?;
        self.keep(m);
        self.op(op)
    }

    fn reshape(&mut self, x: Tn, y: Tn) -> Result<(), String> {
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &self.descs[x.0])?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &self.descs[y.0])?;
        self.op(op)
    }

    /// `S·scale` with the causal mask applied when asked: the scores as softmax sees them.
    fn scaled_masked_scores(&mut self, s: Tn, scale: Tn, dims: [i64; 4], causal: bool) -> Result<Tn, String> {
        let scaled = self.float_op(Pw::CUDNN_POINTWISE_MUL, s, Some(scale), dims)?;
        if !causal {
            return Ok(scaled);
        }
        let int = Dt::CUDNN_DATA_INT32;
        let row = self.virt(int, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            int,
            Some(2),
            scaled,
            None,
            None,
            row,
        )?;
        let col = self.virt(int, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            int,
            Some(3),
            scaled,
            None,
            None,
            col,
        )?;
        let keep = self.virt(Dt::CUDNN_DATA_BOOLEAN, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_CMP_GE,
            Dt::CUDNN_DATA_BOOLEAN,
            None,
            row,
            Some(col),
            None,
            keep,
        )?;
        let lowest = self.scalar(uid::LOWEST)?;
        let masked = self.virt(Dt::CUDNN_DATA_FLOAT, dims)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            Dt::CUDNN_DATA_FLOAT,
            None,
            scaled,
            Some(lowest),
            Some(keep),
            masked,
        )?;
        Ok(masked)
    }
}

fn data_type(dtype: DType) -> Dt {
    match dtype {
        DType::BF16 => Dt::CUDNN_DATA_BFLOAT16,
        _ => Dt::CUDNN_DATA_HALF,
    }
}

fn i64s(v: [usize; 4]) -> [i64; 4] {
    v.map(|e| e as i64)
}

/// Dims 2 and 3 swapped: a `[b, h, s, d]` operand seen as `[b, h, d, s]`.
fn transposed(v: [i64; 4]) -> [i64; 4] {
    [v[0], v[1], v[3], v[2]]
}

/// The problem's sizes as the graph's dims: batch, heads, query and key lengths, head dims of
/// query/key and of value.
fn sizes(p: &SdpaParams) -> [i64; 6] {
    [p.b, p.h, p.s_q, p.s_kv, p.d, p.d_v].map(|n| n as i64)
}

/// The forward graph (module note): operands Q, K, V, O (BSHD), STATS, SCALE, LOWEST.
fn forward_graph(p: &SdpaParams) -> Result<Graph, String> {
    let [b, h, sq, skv, d, dv] = sizes(p);
    let io = data_type(p.dtype);
    let f32 = Dt::CUDNN_DATA_FLOAT;
    let mut g = Graph::new();
    let q = g.io(uid::Q, io, [b, h, sq, d], i64s(p.q.0))?;
    let kt = g.io(uid::K, io, [b, h, d, skv], transposed(i64s(p.k.0)))?;
    let v = g.io(uid::V, io, [b, h, skv, dv], i64s(p.v.0))?;
    let scores = [b, h, sq, skv];
    let rows = [b, h, sq, 1];
    let s = g.virt(f32, scores)?;
    g.matmul(q, kt, s)?;
    let scale = g.scalar(uid::SCALE)?;
    let s = g.scaled_masked_scores(s, scale, scores, p.causal)?;
    // Softmax with statistics, as the frontend's SoftmaxNode (flash mode: no M, Zinv outputs).
    let max = g.virt(f32, rows)?;
    g.reduction(false, s, max)?;
    let shifted = g.float_op(Pw::CUDNN_POINTWISE_SUB, s, Some(max), scores)?;
    let e = g.float_op(Pw::CUDNN_POINTWISE_EXP, shifted, None, scores)?;
    let sum = g.virt(f32, rows)?;
    g.reduction(true, e, sum)?;
    let log_sum = g.float_op(Pw::CUDNN_POINTWISE_LOG, sum, None, rows)?;
    let stats = g.io(uid::STATS, f32, rows, contiguous(rows))?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_ADD,
        f32,
        None,
        max,
        Some(log_sum),
        None,
        stats,
    )?;
    // The weights in the input dtype for the second product.
    let weights = g.virt(io, scores)?;
    g.pointwise(Pw::CUDNN_POINTWISE_DIV, f32, None, e, Some(sum), None, weights)?;
    let o = g.io(uid::O, io, [b, h, sq, dv], i64s(bshd_strides(p.h, p.s_q, p.d_v)))?;
    g.matmul(weights, v, o)?;
    Ok(g)
}

/// The backward graph (module note): operands Q, K, V, O, dO (BSHD), STATS, dQ, dK, dV (BSHD),
/// ROW_SUM and DQ_ACCUM (float scratch), SCALE, LOWEST, ONE.
fn backward_graph(p: &SdpaParams) -> Result<Graph, String> {
    let [b, h, sq, skv, d, dv] = sizes(p);
    let io = data_type(p.dtype);
    let f32 = Dt::CUDNN_DATA_FLOAT;
    let mut g = Graph::new();
    let q = g.io(uid::Q, io, [b, h, sq, d], i64s(p.q.0))?;
    let k_strides = i64s(p.k.0);
    let kt = g.io(uid::K, io, [b, h, d, skv], transposed(k_strides))?;
    let vt = g.io(uid::V, io, [b, h, dv, skv], transposed(i64s(p.v.0)))?;
    let o_strides = i64s(bshd_strides(p.h, p.s_q, p.d_v));
    let o = g.io(uid::O, io, [b, h, sq, dv], o_strides)?;
    let d_o = g.io(uid::D_O, io, [b, h, sq, dv], i64s(p.grads[0]))?;
    let rows = [b, h, sq, 1];
    let scores = [b, h, sq, skv];
    let scores_t = [b, h, skv, sq];
    let scores_t_strides = [h * sq * skv, sq * skv, 1, skv];
    let stats = g.io(uid::STATS, f32, rows, contiguous(rows))?;
    let one = g.scalar(uid::ONE)?;
    let scale = g.scalar(uid::SCALE)?;

    // Σ dO∘O per row, written for the engine.
    let prod = g.float_op(Pw::CUDNN_POINTWISE_MUL, d_o, Some(o), [b, h, sq, dv])?;
    let row_dot = g.virt(f32, rows)?;
    g.reduction(true, prod, row_dot)?;
    let row_sum = g.io(uid::ROW_SUM, f32, rows, contiguous(rows))?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_MUL,
        f32,
        None,
        row_dot,
        Some(one),
        None,
        row_sum,
    )?;

    // The weights again, from the saved statistics.
    let s = g.virt(f32, scores)?;
    g.matmul(q, kt, s)?;
    let s = g.scaled_masked_scores(s, scale, scores, p.causal)?;
    let shifted = g.float_op(Pw::CUDNN_POINTWISE_SUB, s, Some(stats), scores)?;
    let weights = g.float_op(Pw::CUDNN_POINTWISE_EXP, shifted, None, scores)?;

    // dV = Pᵀ·dO.
    let weights_t = g.virt_strided(io, scores_t, scores_t_strides)?;
    g.reshape(weights, weights_t)?;
    let dv_strides = i64s(p.grads[3]);
    let d_v = g.io(uid::D_V, io, [b, h, skv, dv], dv_strides)?;
    g.matmul(weights_t, d_o, d_v)?;

    // dS = P∘(dO·Vᵀ - Σ)·scale.
    let dp = g.virt(f32, scores)?;
    g.matmul(d_o, vt, dp)?;
    let dp = g.float_op(Pw::CUDNN_POINTWISE_MUL, dp, Some(one), scores)?;
    let dp = g.float_op(Pw::CUDNN_POINTWISE_SUB, dp, Some(row_sum), scores)?;
    let ds = g.float_op(Pw::CUDNN_POINTWISE_MUL, dp, Some(weights), scores)?;
    let ds = g.float_op(Pw::CUDNN_POINTWISE_MUL, ds, Some(scale), scores)?;

    // dK = dSᵀ·Q.
    let ds_t = g.virt_strided(io, scores_t, scores_t_strides)?;
    g.reshape(ds, ds_t)?;
    let dk_strides = i64s(p.grads[2]);
    let d_k = g.io(uid::D_K, io, [b, h, skv, d], dk_strides)?;
    g.matmul(ds_t, q, d_k)?;

    // dQ = dS·K, accumulated in float.
    let k = g.virt_strided(io, [b, h, skv, d], k_strides)?;
    g.reshape(kt, k)?;
    let accum = g.io(uid::DQ_ACCUM, f32, [b, h, sq, d], contiguous([b, h, sq, d]))?;
    g.matmul(ds, k, accum)?;
    let dq_strides = i64s(p.grads[1]);
    let d_q = g.io(uid::D_Q, io, [b, h, sq, d], dq_strides)?;
    g.pointwise(Pw::CUDNN_POINTWISE_IDENTITY, f32, None, accum, None, None, d_q)?;
    Ok(g)
}

/// A finalized plan with everything it was built from.
struct Plan {
    plan: Desc,
    _config: Desc,
    _graph: Graph,
    _heur: Desc,
    _op_graph: Desc,
    workspace: usize,
}

/// The first engine configuration of the heuristics (mode A, then the fallback list) whose
/// plan finalizes; `Err` names the step cuDNN refused.
fn plan(handle: sys::cudnnHandle_t, g: Graph) -> Result<Plan, String> {
    let op_graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    let handles: Vec<sys::cudnnBackendDescriptor_t> = g.ops.iter().map(|&i| g.descs[i].0).collect();
    // SAFETY: `handles` holds the finalized operation descriptors of the graph.
    unsafe {
        op_graph.set(
            A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            handles.len() as i64,
            handles.as_ptr().cast(),
        )?
    };
    op_graph.set_handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
    op_graph.finalize()?;
    let mut last = String::from("no engine configuration");
    for mode in [
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        let (heur, configs) = match engine_configs(&op_graph, mode) {
            Ok(found) => found,
            Err(e) => {
                last = e;
                continue;
            }
        };
        for config in configs {
            let Some((plan, workspace)) = finalized_plan(handle, &config)? else {
                last = "no engine configuration's plan finalizes".into();
                continue;
            };
            return Ok(Plan {
                plan,
                _config: config,
                _graph: g,
                _heur: heur,
                _op_graph: op_graph,
                workspace,
            });
        }
    }
    Err(last)
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    backward: bool,
    dtype: DType,
    dims: [usize; 6],
    strides: [[usize; 4]; 3],
    grads: [[usize; 4]; 4],
    causal: bool,
    scale: u64,
}

impl Key {
    fn new(ordinal: usize, backward: bool, p: &SdpaParams) -> Key {
        Key {
            ordinal,
            backward,
            dtype: p.dtype,
            dims: [p.b, p.h, p.s_q, p.s_kv, p.d, p.d_v],
            strides: [p.q.0, p.k.0, p.v.0],
            // The forward does not read them: one plan whatever the backward will choose.
            grads: if backward { p.grads } else { [[0; 4]; 4] },
            causal: p.causal,
            scale: p.scale.to_bits(),
        }
    }
}

thread_local! {
    /// This thread's plans (cuDNN plans belong to the handle they were made with, which is
    /// this thread's: Note [cuDNN state] in `cudnn.rs`); `None` for a problem no engine took.
    static PLANS: RefCell<HashMap<Key, Option<Rc<Plan>>>> = RefCell::default();
}

/// Whether the problem is one the module note lists, before any graph is built.
fn eligible(p: &SdpaParams, ptrs: &[u64]) -> bool {
    let dims_ok = matches!(p.dtype, DType::BF16 | DType::F16)
        && p.d == p.d_v
        && p.d % 8 == 0
        && (8..=128).contains(&p.d)
        && [p.b, p.h, p.s_q, p.s_kv]
            .iter()
            .all(|&n| n > 0 && n < i32::MAX as usize);
    let strides_ok = [p.q.0, p.k.0, p.v.0]
        .iter()
        .chain(&p.grads)
        .all(|s| s[3] == 1 && s[..3].iter().all(|&x| x % 8 == 0));
    dims_ok && strides_ok && ptrs.iter().all(|&a| a % 16 == 0) && p.scale.is_finite()
}

fn cuda_error(msg: String) -> Error {
    Error::Cuda {
        op: "_scaled_dot_product_cudnn_attention",
        msg: format!("cuDNN {msg}"),
    }
}

/// Runs the cached (or newly built) plan of `key` with the `(uid, pointer)` pairs; false
/// where no engine takes the problem.
fn run(rt: &DeviceRuntime, key: Key, p: &SdpaParams, pointers: &[(i64, u64)]) -> Result<bool> {
    let scale = p.scale as f32;
    let lowest = f32::MIN;
    let one = 1.0f32;
    with_handle("_scaled_dot_product_cudnn_attention", rt, |handle| {
        let cached = PLANS.with(|plans| plans.borrow().get(&key).cloned());
        let plan = match cached {
            Some(plan) => plan,
            None => {
                let built = if key.backward {
                    backward_graph(p)
                } else {
                    forward_graph(p)
                }
                .and_then(|g| plan(handle, g));
                let plan = match built {
                    Ok(plan) => Some(Rc::new(plan)),
                    Err(e) => {
                        if std::env::var_os("EMBER_CUDNN_SDPA_DEBUG").is_some() {
                            eprintln!(
                                "ember: cuDNN attention refused ({}): {e}",
                                if key.backward { "backward" } else { "forward" }
                            );
                        }
                        None
                    }
                };
                PLANS.with(|plans| plans.borrow_mut().insert(key, plan.clone()));
                plan
            }
        };
        let Some(plan) = plan else {
            return Ok(false);
        };
        let workspace = if plan.workspace > 0 {
            Some(super::library_buffer(rt, DType::U8, plan.workspace)?)
        } else {
            None
        };
        let mut ids: Vec<i64> = pointers.iter().map(|&(id, _)| id).collect();
        let mut ptrs: Vec<*mut c_void> = pointers.iter().map(|&(_, a)| a as *mut c_void).collect();
        for (id, value) in [(uid::SCALE, &scale), (uid::LOWEST, &lowest), (uid::ONE, &one)] {
            if key.backward || id != uid::ONE {
                if id == uid::LOWEST && !p.causal {
                    continue;
                }
                ids.push(id);
                ptrs.push((value as *const f32).cast_mut().cast());
            }
        }
        let ws = workspace
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| w.ptr_at(0) as *mut c_void);
        let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR).map_err(cuda_error)?;
        // SAFETY: as many ids as pointers; one workspace pointer (null when none is needed).
        unsafe {
            pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &ids)
                .map_err(cuda_error)?;
            pack.set(
                A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                T::CUDNN_TYPE_VOID_PTR,
                ptrs.len() as i64,
                ptrs.as_ptr().cast(),
            )
            .map_err(cuda_error)?;
            pack.set(
                A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                T::CUDNN_TYPE_VOID_PTR,
                1,
                (&ws as *const *mut c_void).cast(),
            )
            .map_err(cuda_error)?;
        }
        pack.finalize().map_err(cuda_error)?;
        super::kernel_timing::note_work(super::stream::current_raw(rt.ordinal));
        // SAFETY: every pointer is a live device buffer of the shape and layout the plan's
        // graph declares (the callers below allocate the outputs and scratch, and pass the
        // inputs at their layouts' offsets), or a host scalar read during this call; the
        // workspace has the plan's bytes; the handle is this thread's, bound to the current
        // stream, and the plan was made with it.
        ok("cudnnBackendExecute", unsafe {
            sys::cudnnBackendExecute(handle, plan.plan.0, pack.0)
        })
        .map_err(cuda_error)?;
        // The workspace goes back to the caching allocator, which reuses it only after the
        // work queued on this stream.
        drop(workspace);
        Ok(true)
    })
}

/// A buffer for an output cuDNN writes (Note [Library outputs under initcheck] in `mod.rs`).
fn output(rt: &DeviceRuntime, dtype: DType, len: usize) -> Result<CudaStorage> {
    super::library_buffer(rt, dtype, len)
}

impl AttentionOps for CudaStorage {
    fn sdpa_forward(&self, key: &Self, value: &Self, p: &SdpaParams) -> Result<Option<(Self, Self)>> {
        let (q, k, v) = (self.ptr_at(p.q.1), key.ptr_at(p.k.1), value.ptr_at(p.v.1));
        if !cudnn::cudnn_on() || !eligible(p, &[q, k, v]) {
            return Ok(None);
        }
        let rt = self.runtime()?;
        let o = output(rt, p.dtype, p.b * p.s_q * p.h * p.d_v)?;
        let lse = output(rt, DType::F32, p.b * p.h * p.s_q)?;
        let pointers = [
            (uid::Q, q),
            (uid::K, k),
            (uid::V, v),
            (uid::O, o.ptr_at(0)),
            (uid::STATS, lse.ptr_at(0)),
        ];
        if !run(rt, Key::new(rt.ordinal, false, p), p, &pointers)? {
            return Ok(None);
        }
        Ok(Some((o, lse)))
    }

    fn sdpa_backward(
        &self,
        key: &Self,
        value: &Self,
        out: &Self,
        lse: &Self,
        grad_out: &Self,
        p: &SdpaParams,
    ) -> Result<Option<SdpaGrads<Self>>> {
        let (q, k, v) = (self.ptr_at(p.q.1), key.ptr_at(p.k.1), value.ptr_at(p.v.1));
        let (o, g) = (out.ptr_at(0), grad_out.ptr_at(0));
        let packed_aligned = p.grads_packed.is_none_or(|pk| {
            pk.offsets
                .iter()
                .all(|&o| (o * p.dtype.size_in_bytes()) % 16 == 0)
        });
        if !cudnn::cudnn_on() || !packed_aligned || !eligible(p, &[q, k, v, o, g]) {
            return Ok(None);
        }
        let rt = self.runtime()?;
        let (grads, [dq, dk, dv]) = match p.grads_packed {
            Some(pk) => {
                let buf = output(rt, p.dtype, pk.len)?;
                let at = pk.offsets.map(|o| buf.ptr_at(o));
                (SdpaGrads::Packed(buf), at)
            }
            None => {
                let dq = output(rt, p.dtype, p.b * p.s_q * p.h * p.d)?;
                let dk = output(rt, p.dtype, p.b * p.s_kv * p.h * p.d)?;
                let dv = output(rt, p.dtype, p.b * p.s_kv * p.h * p.d_v)?;
                let at = [dq.ptr_at(0), dk.ptr_at(0), dv.ptr_at(0)];
                (SdpaGrads::Separate(dq, dk, dv), at)
            }
        };
        let row_sum = output(rt, DType::F32, p.b * p.h * p.s_q)?;
        let accum_len = p.b * p.h * p.s_q * p.d;
        let accum = if cudnn::version().is_some_and(|v| v >= ENGINE_ZEROES_DQ_ACCUM) {
            output(rt, DType::F32, accum_len)?
        } else {
            CudaStorage::full(rt.ordinal, DType::F32, accum_len, 0.0)?
        };
        let pointers = [
            (uid::Q, q),
            (uid::K, k),
            (uid::V, v),
            (uid::O, o),
            (uid::D_O, g),
            (uid::STATS, lse.ptr_at(0)),
            (uid::D_Q, dq),
            (uid::D_K, dk),
            (uid::D_V, dv),
            (uid::ROW_SUM, row_sum.ptr_at(0)),
            (uid::DQ_ACCUM, accum.ptr_at(0)),
        ];
        if !run(rt, Key::new(rt.ordinal, true, p), p, &pointers)? {
            return Ok(None);
        }
        Ok(Some(grads))
    }
}
