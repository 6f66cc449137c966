//! CUDA launchers for `kernels/softmax.cu`: softmax and log_softmax along one dim of any
//! strided layout, and their backward from the saved output, with the CPU backend's formulas
//! (`cpu/softmax.rs`). Rows whose elements are contiguous (the last dim) get lanes along x that
//! read a row together; rows along another dim are taken a row per thread column, so that
//! neighbouring threads read neighbouring memory (see the kernel file's geometry notes).

use super::kernels::{Grid, KernelShape};
use super::launch;
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::op::SoftmaxOp;
use crate::backend::BackendStorage;
use crate::backend::SoftmaxOps;
use crate::layout::Layout;
use crate::{Error, Result};

/// Threads per block.
const BLOCK: usize = 256;
/// Most lanes sharing one row in row mode.
const MAX_ROW_LANES: usize = 512;

/// The rows along `dim`: a merged shape over the other dims with each operand's row base
/// strides, the row count, the row length and each operand's stride along the row.
struct Rows {
    shape: KernelShape,
    nrows: usize,
    k: usize,
    along: Vec<i64>,
}

impl Rows {
    fn new(op: &'static str, dims: &[usize], dim: usize, strides: &[&[usize]]) -> Result<Rows> {
        if dims.is_empty() {
            // A 0-d tensor: one row of one element.
            let none: Vec<&[usize]> = strides.iter().map(|_| &[][..]).collect();
            return Ok(Rows {
                shape: KernelShape::new(op, &[], &none)?,
                nrows: 1,
                k: 1,
                along: vec![0; strides.len()],
            });
        }
        let others = |v: &[usize]| -> Vec<usize> {
            v.iter()
                .enumerate()
                .filter(|&(i, _)| i != dim)
                .map(|(_, &x)| x)
                .collect()
        };
        let rdims = others(dims);
        let rstrides: Vec<Vec<usize>> = strides.iter().map(|s| others(s)).collect();
        let refs: Vec<&[usize]> = rstrides.iter().map(|v| v.as_slice()).collect();
        Ok(Rows {
            shape: KernelShape::new(op, &rdims, &refs)?,
            nrows: rdims.iter().product(),
            k: dims[dim],
            along: strides.iter().map(|s| s[dim] as i64).collect(),
        })
    }

    /// Block shape and grid: row mode (lanes along x) when the input's rows are contiguous or
    /// long and its rows are not neighbours in memory; col mode otherwise.
    fn grid(&self, rt: &DeviceRuntime) -> (Grid, i32) {
        let unit_rows = self.shape.ndim > 0 && self.shape.stride[0][self.shape.ndim as usize - 1] == 1;
        let row = self.k >= 32 && (self.along[0] == 1 || !unit_rows);
        let (bx, by) = if row {
            let lanes = self.k.next_power_of_two().clamp(32, MAX_ROW_LANES);
            (lanes, (BLOCK / lanes).max(1))
        } else {
            let bx = self.nrows.next_power_of_two().min(32);
            (bx, (BLOCK / bx).min(self.k.next_power_of_two()))
        };
        let slots = if row { by } else { bx };
        let groups = self.nrows.div_ceil(slots);
        let grid = Grid {
            grid: (groups.clamp(1, rt.sm_count as usize * 32) as u32, 1, 1),
            block: (bx as u32, by as u32, 1),
            shared_bytes: (bx * by * 8) as u32,
        };
        (grid, row as i32)
    }
}

/// Row-major strides of `dims`.
fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_along_a_middle_dim() {
        // [2, 3, 4] contiguous along dim 1: 8 rows of 3, bases merge to nothing simple.
        let os = contiguous_strides(&[2, 3, 4]);
        assert_eq!(os, vec![12, 4, 1]);
        let r = Rows::new("t", &[2, 3, 4], 1, &[&[12, 4, 1], &os]).unwrap();
        assert_eq!((r.nrows, r.k, r.along.clone()), (8, 3, vec![4, 4]));
        assert_eq!(r.shape.ndim, 2);
        assert_eq!(&r.shape.stride[0][..2], &[12, 1]);
        // Last dim of a contiguous [5, 7]: rows merge into one dim of stride 7.
        let r = Rows::new("t", &[5, 7], 1, &[&[7, 1]]).unwrap();
        assert_eq!((r.nrows, r.k, r.along[0], r.shape.ndim), (5, 7, 1, 1));
        assert_eq!(r.shape.stride[0][0], 7);
        let r = Rows::new("t", &[], 0, &[&[], &[]]).unwrap();
        assert_eq!((r.nrows, r.k, r.shape.ndim), (1, 1, 0));
    }
}

impl SoftmaxOps for CudaStorage {
    /// Softmax or log_softmax along `dim` of `layout`, as a row-major storage of its shape.
    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CudaStorage> {
        let dtype = self.dtype();
        if !dtype.is_floating_point() {
            return Err(Error::dtype(op.name(), dtype));
        }
        let rt = self.runtime()?;
        let n = layout.numel();
        let out = CudaStorage::alloc_on(rt, dtype, n)?;
        if n == 0 {
            return Ok(out);
        }
        let os = contiguous_strides(layout.dims());
        let rows = Rows::new(op.name(), layout.dims(), dim, &[layout.strides(), &os])?;
        let (grid, row) = rows.grid(rt);
        let (x, o) = (self.dev_ptr(layout), out.dev_ptr_mut_at(0));
        let (nrows, k, xs, ost) = (rows.nrows as i64, rows.k as i64, rows.along[0], rows.along[1]);
        let log = (op == SoftmaxOp::LogSoftmax) as i32;
        // Row bases and strides come from `layout` (valid for this storage) and from the
        // row-major strides of `out`, which holds `n` elements; shared memory is bx * by doubles.
        launch::softmax(rt, &[dtype], grid, x, o, &rows.shape, nrows, k, xs, ost, log, row)?;
        Ok(out)
    }

    /// The input gradient of `op` along `dim` from its output (`self`, at `yl`) and the
    /// output's gradient (same shape and dtype).
    fn softmax_backward(
        &self,
        yl: &Layout,
        grad: &CudaStorage,
        gl: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<CudaStorage> {
        let dtype = self.dtype();
        if dtype != grad.dtype() || !dtype.is_floating_point() {
            return Err(Error::DTypeMismatch {
                op: op.name(),
                expected: dtype,
                found: grad.dtype(),
            });
        }
        if self.ordinal() != grad.ordinal() {
            return Err(Error::DeviceMismatch {
                op: op.name(),
                lhs: self.device(),
                rhs: grad.device(),
            });
        }
        let rt = self.runtime()?;
        let n = yl.numel();
        let out = CudaStorage::alloc_on(rt, dtype, n)?;
        if n == 0 {
            return Ok(out);
        }
        let os = contiguous_strides(yl.dims());
        let rows = Rows::new(op.name(), yl.dims(), dim, &[yl.strides(), gl.strides(), &os])?;
        let (grid, row) = rows.grid(rt);
        let (y, g, o) = (self.dev_ptr(yl), grad.dev_ptr(gl), out.dev_ptr_mut_at(0));
        let (nrows, k) = (rows.nrows as i64, rows.k as i64);
        let (ys, gs, ost) = (rows.along[0], rows.along[1], rows.along[2]);
        let log = (op == SoftmaxOp::LogSoftmax) as i32;
        // `y` and `g` are read through their valid layouts (same shape), `out` holds `n`
        // row-major elements.
        launch::softmax_backward(
            rt,
            &[dtype],
            grid,
            y,
            g,
            o,
            &rows.shape,
            nrows,
            k,
            ys,
            gs,
            ost,
            log,
            row,
        )?;
        Ok(out)
    }
}
