//! CUDA launcher for `kernels/unary.cu`: math functions and activations of one operand, with
//! the dtype rules of `ops/unary.rs` (Note [Unary dtypes]) and the formulas of `cpu/unary.rs`.
//!
//! Every op has a kernel per dtype, `unary_<op>_<T>` (the op's kernel name from the op table,
//! `backend/table.rs`), with the op's parameters as `c0..c2`. Float inputs run the float
//! kernel of their dtype; integer and bool inputs of float ops are cast to f32 first (as the
//! CPU converts each element to f32); integer-preserving ops run their wrapping integer kernel,
//! and the rounding ops on integers, abs/sign of bool and square of bool are plain (casting)
//! copies.

use super::cudnn;
use super::cudnn::cudnn_on;
use super::kernels::{Grid, KernelShape};
use super::launch;
use super::storage::CudaStorage;
use crate::backend::op::{Ints, UnaryOp};
use crate::backend::BackendStorage;
use crate::backend::{CopyOps, UnaryOps};
use crate::layout::Layout;
use crate::{DType, Result};

impl CudaStorage {
    /// Launches `unary_<op>_T` over `layout`, output of the same dtype.
    fn unary_kernel(&self, op: UnaryOp, layout: &Layout) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let dtype = self.dtype();
        let n = layout.numel();
        let out = CudaStorage::alloc_on(rt, dtype, n)?;
        if n == 0 {
            return Ok(out);
        }
        // The output is row-major over the same index, so merging dims contiguous in the input
        // keeps the mapping; only the input's strides travel.
        let shape = KernelShape::new(op.name(), layout.dims(), &[layout.strides()])?;
        let mode: i32 = if shape.is_contiguous(0) { 0 } else { 1 };
        // The contiguous path handles 16 bytes per thread per iteration.
        let items = if mode == 0 {
            n.div_ceil(16 / dtype.size_in_bytes())
        } else {
            n
        };
        let [c0, c1, c2] = op.kernel_params();
        let grid = Grid::linear(rt, items, 256);
        // `x` reaches only elements of this storage through `shape` (the strides of a valid
        // layout); `out` holds `n` elements.
        launch::unary(
            rt,
            op,
            &[dtype],
            grid,
            self.dev_ptr(layout),
            out.dev_ptr_mut_at(0),
            &shape,
            n as i64,
            c0,
            c1,
            c2,
            mode,
        )?;
        Ok(out)
    }
}

impl UnaryOps for CudaStorage {
    /// `op` over the elements of `layout`, in a new row-major storage of
    /// `op.result_dtype(self.dtype())`.
    #[inline]
    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CudaStorage> {
        let dtype = self.dtype();
        let out_dtype = op.result_dtype(dtype)?;
        if dtype.is_floating_point() {
            return self.unary_kernel(op, layout);
        }
        if out_dtype.is_floating_point() {
            // Integer or bool input of a float op: f32 values, then the f32 kernel.
            let x = self.to_dtype(layout, DType::F32)?;
            return x.unary_kernel(op, &Layout::contiguous(layout.shape().clone()));
        }
        match op.ints() {
            // bool: abs/sign are the bool itself, square gives int64 (0 or 1); integers: the
            // rounding ops are copies. `to_dtype` casts exactly as the CPU does here.
            _ if dtype == DType::Bool => self.to_dtype(layout, out_dtype),
            Ints::Whole => self.to_dtype(layout, dtype),
            _ => self.unary_kernel(op, layout),
        }
    }

    /// The float kernel with `self` as both its input and its output: each element is read
    /// before the same thread writes it, and no two indices share an element (the vector path
    /// runs only when the pointer is 16-byte aligned, as out of place).
    fn unary_inplace(&mut self, op: UnaryOp, layout: &Layout) -> Result<bool> {
        let dtype = self.dtype();
        if !dtype.is_floating_point() || op.result_dtype(dtype)? != dtype || !layout.is_contiguous() {
            return Ok(false);
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(true);
        }
        let rt = self.runtime()?;
        let shape = KernelShape::new(op.name(), layout.dims(), &[layout.strides()])?;
        let [c0, c1, c2] = op.kernel_params();
        let grid = Grid::linear(rt, n.div_ceil(16 / dtype.size_in_bytes()), 256);
        let o = self.dev_ptr_mut(layout);
        launch::unary(
            rt,
            op,
            &[dtype],
            grid,
            o.read_only(),
            o,
            &shape,
            n as i64,
            c0,
            c1,
            c2,
            0,
        )?;
        Ok(true)
    }

    fn relu_backward(&self, grad_out: &CudaStorage, len: usize) -> Result<Option<CudaStorage>> {
        if !cudnn_on() {
            return Ok(None);
        }
        cudnn::relu_backward(self, grad_out, len)
    }
}
