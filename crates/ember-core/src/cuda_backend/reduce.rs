//! CUDA launchers for `kernels/reduce.cu`: every [`ReduceOp`] over any set of dims of any
//! strided layout, and max/min with the indices of their first occurrence. Semantics (dtypes,
//! errors, NaN handling, ties, empty inputs) are the CPU backend's, `cpu/reduce.rs`.
//!
//! Note [CUDA reduction plans]: the input is seen as M outputs (the kept dims) each reducing K
//! elements (the reduced dims), two merged `Strided` descriptors giving the offsets. When the
//! reduced dims are contiguous and K is large, lanes along x share an output ("row" mode);
//! otherwise, e.g. a sum over dim 0 where neighbouring outputs are neighbours in memory, each
//! output is reduced by lanes along y and neighbouring threads take neighbouring outputs
//! ("col" mode; with K <= 8 a thread per output). When there are too few output groups to
//! fill the device (a full reduction), K is cut into chunks over `gridDim.y`, each block
//! writes a partial state, and a second launch combines each output's partials in a fixed
//! order: results are deterministic and no atomics are used.

use super::kernels::{Grid, KernelShape};
use super::launch::{
    self, reduce, reduce_final, ArgVariant, DevPtrMut, MinmaxVariant, SumVariant, VarVariant,
};
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::op::ReduceOp;
use crate::backend::BackendStorage;
use crate::backend::ReduceOps;
use crate::layout::Layout;
use crate::{DType, Error, Result};

/// Bytes of partial-state buffer per (output, chunk): every kernel's State fits (the kernels
/// `static_assert` it).
const STATE_BYTES: usize = 32;
/// Threads per block of the first pass.
const BLOCK: usize = 256;
/// Elements each lane should reduce per chunk before K is split further (bounds the split).
/// Small enough that a reduction of a few hundred elements per output over few outputs (a
/// linear layer's bias gradient, [256, 128] over dim 0) is split over several blocks instead
/// of leaving each lane a long chain of dependent loads.
const MIN_PER_LANE: usize = 8;
/// Elements each lane of a row should get before a row takes more lanes: with fewer lanes per
/// output a block serves several outputs and the tree over the lanes is shorter (a row of 196
/// or 784 elements, a convolution bias gradient's spatial sums, takes 32 or 64 lanes, not 256).
const ROW_PER_LANE: usize = 16;

/// The kernels of the two passes, their `variant` and `param` arguments and the output dtype
/// of `op` on `dtype`.
struct Kernel {
    base: reduce::Name,
    final_base: reduce_final::Name,
    variant: i32,
    param: f64,
    out_dtype: DType,
}

fn kernel_for(op: ReduceOp, dtype: DType, k: usize) -> Result<Kernel> {
    let float = dtype.is_floating_point();
    let sum_dtype = if float { dtype } else { DType::I64 };
    let kernel = |base, final_base, variant, param, out_dtype| Kernel {
        base,
        final_base,
        variant,
        param,
        out_dtype,
    };
    let (sum_k, sum_final) = (reduce::reduce_sum, reduce_final::reduce_sum_final);
    let (minmax_k, minmax_final) = (reduce::reduce_minmax, reduce_final::reduce_minmax_final);
    let (arg_k, arg_final) = (reduce::reduce_arg, reduce_final::reduce_arg_final);
    let (var_k, var_final) = (reduce::reduce_var, reduce_final::reduce_var_final);
    let sum = |variant: SumVariant, param| kernel(sum_k, sum_final, variant as i32, param, dtype);
    let minmax = |variant| kernel(minmax_k, minmax_final, variant, 0.0, dtype);
    Ok(match op {
        ReduceOp::Sum => kernel(sum_k, sum_final, SumVariant::Sum as i32, 0.0, sum_dtype),
        ReduceOp::Prod => kernel(
            reduce::reduce_prod,
            reduce_final::reduce_prod_final,
            0,
            0.0,
            sum_dtype,
        ),
        ReduceOp::Max => minmax(MinmaxVariant::Max as i32),
        ReduceOp::Min => minmax(MinmaxVariant::Min as i32),
        ReduceOp::ArgMax => kernel(arg_k, arg_final, ArgVariant::Max as i32, 0.0, DType::I64),
        ReduceOp::ArgMin => kernel(arg_k, arg_final, ArgVariant::Min as i32, 0.0, DType::I64),
        _ if !float => return Err(Error::dtype(op.name(), dtype)),
        ReduceOp::Mean => sum(SumVariant::Mean, k as f64),
        ReduceOp::LogSumExp => kernel(reduce::reduce_lse, reduce_final::reduce_lse_final, 0, 0.0, dtype),
        ReduceOp::Var { correction } => kernel(var_k, var_final, VarVariant::Var as i32, correction, dtype),
        ReduceOp::Std { correction } => kernel(var_k, var_final, VarVariant::Std as i32, correction, dtype),
        ReduceOp::Norm { p } if p == 2.0 => sum(SumVariant::L2, 0.0),
        ReduceOp::Norm { p } if p == 1.0 => sum(SumVariant::L1, 0.0),
        ReduceOp::Norm { p } if p == f64::INFINITY => minmax(MinmaxVariant::MaxAbs as i32),
        ReduceOp::Norm { p } if p == f64::NEG_INFINITY => minmax(MinmaxVariant::MinAbs as i32),
        ReduceOp::Norm { p } if p == 0.0 => sum(SumVariant::L0, 0.0),
        ReduceOp::Norm { p } => sum(SumVariant::Lp, p),
    })
}

/// The result of `op` over zero elements (the CPU's `finish(identity)`); `None` for the ops
/// without an identity (max, min, argmax, argmin).
fn empty_value(op: ReduceOp) -> Option<f64> {
    Some(match op {
        ReduceOp::Sum => 0.0,
        ReduceOp::Prod => 1.0,
        ReduceOp::Mean => f64::NAN,
        // 0 / max(0, 0 - correction): NaN unless the correction is negative, as on the CPU.
        ReduceOp::Var { correction } => 0.0 / (-correction).max(0.0),
        ReduceOp::Std { correction } => (0.0 / (-correction).max(0.0)).sqrt(),
        ReduceOp::LogSumExp => f64::NEG_INFINITY,
        ReduceOp::Norm { p } if p == f64::INFINITY => 0.0,
        ReduceOp::Norm { p } if p == f64::NEG_INFINITY => f64::INFINITY,
        ReduceOp::Norm { p } if p == 0.0 || p == 1.0 || p == 2.0 => 0.0,
        ReduceOp::Norm { p } => 0f64.powf(1.0 / p),
        ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin => return None,
    })
}

/// The error for max/min/argmax over zero elements, as the CPU backend words it.
fn empty_reduction(op: &'static str) -> Error {
    Error::invalid(
        op,
        "expected the reduced dims to have a non-zero size: the operation has no identity",
    )
}

/// M outputs (kept dims, `outer`) each reducing K elements (reduced dims, `inner`); both
/// describe offsets into the input (see Note [CUDA reduction plans]).
struct Geometry {
    outer: KernelShape,
    inner: KernelShape,
    m: usize,
    k: usize,
}

impl Geometry {
    fn new(op: &'static str, layout: &Layout, dims: &[usize]) -> Result<Geometry> {
        let rank = layout.dims().len();
        let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
        let pick = |ds: &[usize]| -> (Vec<usize>, Vec<usize>) {
            (
                ds.iter().map(|&d| layout.dims()[d]).collect(),
                ds.iter().map(|&d| layout.strides()[d]).collect(),
            )
        };
        let (kd, ks) = pick(&kept);
        let (rd, rs) = pick(dims);
        Ok(Geometry {
            outer: KernelShape::new(op, &kd, &[&ks])?,
            inner: KernelShape::new(op, &rd, &[&rs])?,
            m: kd.iter().product(),
            k: rd.iter().product(),
        })
    }
}

/// True when the innermost merged dim of operand 0 has stride 1.
fn unit_last(s: &KernelShape) -> bool {
    s.ndim > 0 && s.stride[0][s.ndim as usize - 1] == 1
}

/// Note [Column sums]: a sum over dim 0 of a row-major `[k, m]` half matrix (the bias
/// gradients of a linear layer; GPT-2's step has 48) took 76 µs a launch in col mode (one
/// 2-byte load per thread per step: 370 GB/s on an H200), 3.7 ms of a 25 ms step; the column
/// kernel took 15 µs for both passes (0.73 ms a step; docs/benchmarks.md, session 44). It reads
/// 16-byte words, four rows in flight per thread, with blocks of `COL_THREADS` threads: up to
/// 32 (`COL_BX`) column words across, the rest along the rows. K is split until the device has
/// ~4 blocks per SM, each thread keeping at least `COL_ROWS_PER_LANE` rows, and at most
/// `COL_MAX_ROWS_PER_LANE`: a thread's rows are a running sum, and 237 of them (4 columns of
/// a million rows, split for parallelism alone) lost the 1e-6 relative accuracy that
/// `reduce::f32_sums_are_accurate` asks of an f32 sum of 0.1s.
const COL_THREADS: usize = 256;
const COL_BX: usize = 32;
const COL_ROWS_PER_LANE: usize = 8;
const COL_MAX_ROWS_PER_LANE: usize = 32;

/// Block shape, grid and K split of the first pass.
struct Plan {
    row: bool,
    bx: usize,
    by: usize,
    grid_x: usize,
    splits: usize,
    chunk: usize,
}

fn plan(rt: &DeviceRuntime, g: &Geometry) -> Plan {
    let (m, k) = (g.m, g.k);
    let row = k >= 32 && (unit_last(&g.inner) || !unit_last(&g.outer));
    let (bx, by) = if row {
        let lanes = (k / ROW_PER_LANE).next_power_of_two().clamp(32, BLOCK);
        (lanes, BLOCK / lanes)
    } else if k <= 8 {
        (BLOCK, 1)
    } else {
        let bx = m.next_power_of_two().min(32);
        (bx, BLOCK / bx)
    };
    let (lanes, slots) = if row { (bx, by) } else { (by, bx) };
    let groups = m.div_ceil(slots);
    let target = rt.sm_count as usize * 4;
    let splits = if groups < target {
        let want = target.div_ceil(groups);
        let work = k.div_ceil(lanes * MIN_PER_LANE);
        want.min(work).clamp(1, 65535)
    } else {
        1
    };
    let chunk = k.div_ceil(splits);
    Plan {
        row,
        bx,
        by,
        grid_x: groups.min(rt.sm_count as usize * 32).max(1),
        splits: k.div_ceil(chunk),
        chunk,
    }
}

impl CudaStorage {
    /// Runs the reduction kernel `kernel` over `g`, writing `out` (values, may be `None` for
    /// argmax/argmin) and `idx` (i64 indices, `None` unless an arg kernel); needs M, K > 0.
    fn run_reduce(
        &self,
        layout: &Layout,
        kernel: &Kernel,
        g: &Geometry,
        out: Option<DevPtrMut<'_>>,
        idx: Option<DevPtrMut<'_>>,
    ) -> Result<()> {
        let rt = self.runtime()?;
        let p = plan(rt, g);
        let dtype = self.dtype();
        let partials = if p.splits > 1 {
            Some(CudaStorage::alloc_on(
                rt,
                DType::U8,
                g.m * p.splits * STATE_BYTES,
            )?)
        } else {
            None
        };
        let part = partials.as_ref().map(|s| s.dev_ptr_mut_at(0));
        let (x, m, k, chunk) = (self.dev_ptr(layout), g.m as i64, g.k as i64, p.chunk as i64);
        let (row, variant, param) = (p.row as i32, kernel.variant, kernel.param);
        let grid = Grid {
            grid: (p.grid_x as u32, p.splits as u32, 1),
            block: (p.bx as u32, p.by as u32, 1),
            shared_bytes: (p.bx * p.by * STATE_BYTES) as u32,
        };
        // `outer`/`inner` come from the valid `layout` of this storage, so every offset the
        // kernel forms (outputs < m, elements < k) is inside it; `out`/`idx` hold m elements
        // of the kernel's result type / i64 (or are null where the kernel skips them);
        // `partial` holds m * gridDim.y states of at most STATE_BYTES each; shared memory is
        // bx * by states.
        let (first_out, first_idx) = if p.splits > 1 { (None, None) } else { (out, idx) };
        launch::reduce(
            rt,
            kernel.base,
            &[dtype],
            grid,
            x,
            &g.outer,
            &g.inner,
            m,
            k,
            chunk,
            row,
            variant,
            param,
            first_out,
            first_idx,
            part,
        )?;
        let Some(part) = part else {
            return Ok(());
        };
        let lanes = p.splits.next_power_of_two().clamp(32, BLOCK);
        let splits = p.splits as i64;
        let grid = Grid {
            grid: (g.m.min(rt.sm_count as usize * 32) as u32, 1, 1),
            block: (lanes as u32, 1, 1),
            shared_bytes: (lanes * STATE_BYTES) as u32,
        };
        // `partial` holds m * splits states written by the first pass earlier on this stream;
        // `out`/`idx` as above.
        let part = part.read_only();
        let kernel = kernel.final_base;
        launch::reduce_final(
            rt,
            kernel,
            &[dtype],
            grid,
            part,
            m,
            splits,
            variant,
            param,
            out,
            idx,
        )?;
        // `partials` returns to the allocator's pool of this stream, where no later work can
        // reuse it before the kernels above have run.
        drop(partials);
        Ok(())
    }

    /// A plain float sum whose outputs are contiguous columns and whose reduced elements are
    /// one strided dim (a sum over dim 0 of a row-major matrix: a linear layer's bias
    /// gradient), in 16-byte column words (`reduce.cu`'s `cols_sum`; Note [Column sums]):
    /// writes `out` and returns true, or returns false when the view does not have that shape.
    fn sum_columns(&self, layout: &Layout, g: &Geometry, out: &CudaStorage) -> Result<bool> {
        let dtype = self.dtype();
        if !dtype.is_floating_point() || g.outer.ndim != 1 || g.inner.ndim != 1 {
            return Ok(false);
        }
        let v = 16 / dtype.size_in_bytes();
        let row_stride = g.inner.stride[0][0];
        let (m, k) = (g.m, g.k);
        let aligned = self.ptr(layout) % 16 == 0 && m % v == 0 && row_stride % v as i64 == 0;
        if g.outer.stride[0][0] != 1 || !aligned || k < 8 {
            return Ok(false);
        }
        let rt = self.runtime()?;
        let acc = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        // Few column words (a sum over dim 0 of a narrow matrix) take more lanes along the rows.
        let bx = (m / v).next_power_of_two().min(COL_BX);
        let by = COL_THREADS / bx;
        let grid_x = (m / v).div_ceil(bx);
        let target = rt.sm_count as usize * 4;
        let want = if grid_x < target {
            target.div_ceil(grid_x)
        } else {
            1
        };
        let splits = want
            .min(k.div_ceil(by * COL_ROWS_PER_LANE))
            .max(k.div_ceil(by * COL_MAX_ROWS_PER_LANE))
            .clamp(1, 65535);
        let chunk = k.div_ceil(splits);
        let splits = k.div_ceil(chunk);
        let partials = if splits > 1 {
            Some(CudaStorage::alloc_on(rt, acc, splits * m)?)
        } else {
            None
        };
        let grid = Grid {
            grid: (grid_x as u32, splits as u32, 1),
            block: (bx as u32, by as u32, 1),
            shared_bytes: (COL_THREADS * v * acc.size_in_bytes()) as u32,
        };
        let part = partials.as_ref().map(|p| p.dev_ptr_mut_at(0));
        let first_out = if part.is_some() {
            None
        } else {
            Some(out.dev_ptr_mut_at(0))
        };
        // The checks above: m contiguous columns, k rows `row_stride` apart inside this valid
        // layout, every 16-byte word aligned; `out` holds m elements, `partial` splits * m.
        launch::reduce_cols_sum(
            rt,
            &[dtype],
            grid,
            self.dev_ptr(layout),
            row_stride,
            m as i64,
            k as i64,
            chunk as i64,
            first_out,
            part,
        )?;
        if let Some(p) = &partials {
            // `partial` holds splits * m sums written by the first pass on this stream.
            launch::reduce_cols_sum_final(
                rt,
                &[dtype],
                Grid::linear(rt, m * 32, BLOCK as u32),
                p.dev_ptr_at(0),
                m as i64,
                splits as i64,
                out.dev_ptr_mut_at(0),
            )?;
        }
        // `partials` returns to this stream's pool, where no later work can reuse it before
        // the kernels above have run.
        drop(partials);
        Ok(true)
    }
}

impl ReduceOps for CudaStorage {
    /// `op` over `dims` (sorted, unique) of `layout`, as a row-major storage of the kept dims.
    #[inline]
    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CudaStorage> {
        let g = Geometry::new(op.name(), layout, dims)?;
        let empty = empty_value(op);
        if g.k == 0 && empty.is_none() {
            return Err(empty_reduction(op.name()));
        }
        let kernel = kernel_for(op, self.dtype(), g.k)?;
        let rt = self.runtime()?;
        if g.k == 0 {
            return CudaStorage::full(rt.ordinal, kernel.out_dtype, g.m, empty.unwrap_or(0.0));
        }
        let out = CudaStorage::alloc_on(rt, kernel.out_dtype, g.m)?;
        if g.m == 0 {
            return Ok(out);
        }
        if matches!(op, ReduceOp::Sum) && self.sum_columns(layout, &g, &out)? {
            return Ok(out);
        }
        let (o, idx) = match op {
            ReduceOp::ArgMax | ReduceOp::ArgMin => (None, Some(out.dev_ptr_mut_at(0))),
            _ => (Some(out.dev_ptr_mut_at(0)), None),
        };
        self.run_reduce(layout, &kernel, &g, o, idx)?;
        Ok(out)
    }

    /// Max or min over `dims` with the i64 index of its first occurrence (indices into the
    /// flattened reduced dims; NaN counts as the extreme).
    fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CudaStorage, CudaStorage)> {
        let variant = match op {
            ReduceOp::Max => ArgVariant::Max as i32,
            ReduceOp::Min => ArgVariant::Min as i32,
            _ => return Err(Error::invalid(op.name(), "only max and min return indices")),
        };
        let g = Geometry::new(op.name(), layout, dims)?;
        if g.k == 0 {
            return Err(empty_reduction(op.name()));
        }
        let rt = self.runtime()?;
        let values = CudaStorage::alloc_on(rt, self.dtype(), g.m)?;
        let indices = CudaStorage::alloc_on(rt, DType::I64, g.m)?;
        if g.m == 0 {
            return Ok((values, indices));
        }
        let kernel = Kernel {
            base: reduce::reduce_arg,
            final_base: reduce_final::reduce_arg_final,
            variant,
            param: 0.0,
            out_dtype: self.dtype(),
        };
        let (v, i) = (values.dev_ptr_mut_at(0), indices.dev_ptr_mut_at(0));
        self.run_reduce(layout, &kernel, &g, Some(v), Some(i))?;
        Ok((values, indices))
    }
}
