//! CUDA launcher for `kernels/unary.cu`: math functions and activations of one operand, with
//! the dtype rules of `ops/unary.rs` (Note [Unary dtypes]) and the formulas of `cpu/unary.rs`.
//!
//! Float inputs run the float kernel of their dtype; integer and bool inputs of float ops are
//! cast to f32 first (as the CPU converts each element to f32); integer-preserving ops run the
//! wrapping integer kernel, and the rounding ops on integers, abs/sign of bool and square of
//! bool are plain (casting) copies.

use super::kernel_units::UNARY_KERNELS;
use super::kernels::{launch, Grid, KernelKey, KernelShape, Module};
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::op::UnaryOp;
use crate::layout::Layout;
use crate::{DType, Result};
use std::f64::consts::{FRAC_1_SQRT_2, PI};

/// The op's code in `unary.cu` and its parameters (p0, p1, p2).
fn code(op: UnaryOp) -> (i32, [f64; 3]) {
    use UnaryOp::*;
    let none = [0.0; 3];
    match op {
        Neg => (0, none),
        Abs => (1, none),
        Sign => (2, none),
        Square => (3, none),
        Reciprocal => (4, none),
        Sqrt => (5, none),
        Rsqrt => (6, none),
        Exp => (7, none),
        Exp2 => (8, none),
        Expm1 => (9, none),
        Log => (10, none),
        Log2 => (11, none),
        Log10 => (12, none),
        Log1p => (13, none),
        Sin => (14, none),
        Cos => (15, none),
        Tan => (16, none),
        Asin => (17, none),
        Acos => (18, none),
        Atan => (19, none),
        Sinh => (20, none),
        Cosh => (21, none),
        Tanh => (22, none),
        Erf => (23, none),
        Erfc => (24, none),
        Floor => (25, none),
        Ceil => (26, none),
        Round => (27, none),
        Trunc => (28, none),
        Sigmoid => (29, none),
        LogSigmoid => (30, none),
        Relu => (31, none),
        LeakyRelu { negative_slope } => (32, [negative_slope, 0.0, 0.0]),
        // The CPU rounds `alpha * scale` (computed in f64) to the compute type once: same here.
        Elu {
            alpha,
            scale,
            input_scale,
        } => (33, [alpha * scale, scale, input_scale]),
        Hardtanh { min, max } => (34, [min, max, 0.0]),
        Hardsigmoid => (35, none),
        Hardswish => (36, none),
        Gelu => (37, [FRAC_1_SQRT_2, 0.0, 0.0]),
        GeluTanh => (38, [(2.0 / PI).sqrt(), crate::backend::op::GELU_TANH_KAPPA, 0.0]),
        Silu => (39, none),
        Mish => (40, none),
        Softplus { beta, threshold } => (41, [beta, threshold, 0.0]),
        Softsign => (42, none),
        AddScalar { value } => (43, [value, 0.0, 0.0]),
        SubScalar { value } => (44, [value, 0.0, 0.0]),
        MulScalar { value } => (45, [value, 0.0, 0.0]),
        DivScalar { value } => (46, [value, 0.0, 0.0]),
    }
}

impl CudaStorage {
    /// `op` over the elements of `layout`, in a new row-major storage of
    /// `op.result_dtype(self.dtype())`.
    pub(crate) fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CudaStorage> {
        let dtype = self.dtype();
        let out_dtype = op.result_dtype(dtype)?;
        if dtype.is_floating_point() {
            return self.unary_kernel(op, layout, "unary");
        }
        if out_dtype.is_floating_point() {
            // Integer or bool input of a float op: f32 values, then the f32 kernel.
            let x = self.to_dtype(layout, DType::F32)?;
            return x.unary_kernel(op, &Layout::contiguous(layout.shape().clone()), "unary");
        }
        match op {
            // bool: abs/sign are the bool itself, square gives int64 (0 or 1); integers: the
            // rounding ops are copies. `to_dtype` casts exactly as the CPU does here.
            _ if dtype == DType::Bool => self.to_dtype(layout, out_dtype),
            UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Trunc => self.to_dtype(layout, dtype),
            _ => self.unary_kernel(op, layout, "unary_int"),
        }
    }

    /// Launches `base_T` (`unary` or `unary_int`) over `layout`, output of the same dtype.
    fn unary_kernel(&self, op: UnaryOp, layout: &Layout, base: &'static str) -> Result<CudaStorage> {
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
        let (code, [p0, p1, p2]) = code(op);
        // Float ops have a kernel each (`unary_relu_f32`), integer ops share `unary_int_T`.
        let kernel = if base == "unary" {
            UNARY_KERNELS[code as usize]
        } else {
            base
        };
        let f = rt.function(KernelKey::new(Module::Unary, kernel, dtype))?;
        let (x, o, n64) = (self.ptr(layout), out.ptr_at(0), n as i64);
        let stream = current_raw(rt.ordinal);
        let grid = Grid::linear(rt, items, 256);
        // SAFETY: `unary_<op>_T(const T* x, T* out, Strided s, i64 n, i32 op, f64 p0, f64 p1, f64 p2,
        // i32 mode)` or `unary_int_T(const T* x, T* out, Strided s, i64 n, i32 op, i32 mode)`,
        // arguments in that order and of those types; `x` reaches only elements of this storage
        // through `shape` (the strides of a valid layout), `out` holds `n` elements of T.
        unsafe {
            if base == "unary" {
                launch(
                    f,
                    grid,
                    stream,
                    &[&x, &o, &shape, &n64, &code, &p0, &p1, &p2, &mode],
                )?;
            } else {
                launch(f, grid, stream, &[&x, &o, &shape, &n64, &code, &mode])?;
            }
        }
        Ok(out)
    }
}
