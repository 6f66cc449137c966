//! CUDA launchers for `kernels/elementwise.cu`: arithmetic, comparisons, logical ops and
//! `where` on operands whose layouts were already broadcast to one shape.

use super::device_errors::Kind;
use super::kernels::{Grid, KernelShape};
use super::launch::{self, DevPtr, DevPtrMut};
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::op::Promotion;
use crate::backend::op::{BinaryOp, Bools, CmpOp, Ints, LogicalOp};
use crate::backend::BackendStorage;
use crate::backend::ElementwiseOps;
use crate::layout::Layout;
use crate::{DType, Error, Result};

/// The loop shape `elementwise.cu` runs (its `mode` argument).
fn mode(shape: &KernelShape) -> i32 {
    match (shape.is_contiguous(0), shape.is_contiguous(1)) {
        (true, true) => 0,
        (true, false) if shape.is_scalar(1) => 1,
        (false, true) if shape.is_scalar(0) => 2,
        _ => 3,
    }
}

fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            found: b.dtype(),
        });
    }
    if a.ordinal() != b.ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}

/// Which two-operand kernel family a launch runs.
#[derive(Debug, Clone, Copy)]
enum TwoOperand {
    Binary(BinaryOp),
    Compare(CmpOp),
    Logical(LogicalOp),
}

impl TwoOperand {
    fn name(self) -> &'static str {
        match self {
            TwoOperand::Binary(op) => op.name(),
            TwoOperand::Compare(op) => op.name(),
            TwoOperand::Logical(op) => op.name(),
        }
    }
}

/// Launches `kind`'s kernel for operands of `dtype`: `a` at `al` and `b` at `bl` (layouts of one
/// broadcast shape) into `o`, row-major with room for `al.numel()` elements of the output
/// dtype; `o` overlaps no operand, or is exactly `a` (in place).
#[allow(clippy::too_many_arguments)]
fn launch_two(
    kind: TwoOperand,
    dtype: DType,
    a: DevPtr<'_>,
    al: &Layout,
    b: DevPtr<'_>,
    bl: &Layout,
    o: DevPtrMut<'_>,
    rt: &DeviceRuntime,
) -> Result<()> {
    let n = al.numel();
    if n == 0 {
        return Ok(());
    }
    let shape = KernelShape::new(kind.name(), al.dims(), &[al.strides(), bl.strides()])?;
    let (n64, m) = (n as i64, mode(&shape));
    // The vectorized modes move 4 packs of 16 bytes per thread (elementwise.cu's UNROLL):
    // one thread per 4 packs, as many blocks as that takes, so no thread loops.
    let grid = if m == 3 {
        Grid::linear(rt, n, 256)
    } else {
        let per_thread = 4 * (16 / dtype.size_in_bytes()).min(16);
        Grid::exact(n.div_ceil(per_thread), 256)
    };
    // `a` and `b` reach only elements inside their storages through `shape`'s strides (valid
    // layouts), `o` holds `n` elements.
    match kind {
        TwoOperand::Binary(op) => launch::binary(rt, op, &[dtype], grid, a, b, o, &shape, n64, m),
        TwoOperand::Compare(op) => launch::compare(rt, op, &[dtype], grid, a, b, o, &shape, n64, m),
        TwoOperand::Logical(op) => launch::logical(rt, op, &[], grid, a, b, o, &shape, n64, m),
    }
}

impl CudaStorage {
    /// Launches `kind`'s kernel writing a new row-major storage of `out_dtype`.
    fn two_operand(
        &self,
        kind: TwoOperand,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        out_dtype: DType,
    ) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let out = CudaStorage::alloc_on(rt, out_dtype, al.numel())?;
        let (a, b) = (self.dev_ptr(al), rhs.dev_ptr(bl));
        launch_two(kind, self.dtype(), a, al, b, bl, out.dev_ptr_mut_at(0), rt)?;
        Ok(out)
    }

    /// `lhs op rhs` for a float32 and a float16 or bfloat16 operand (either order), in float32
    /// (Note [Mixed operands] in `elementwise.cu`).
    fn binary_mixed(&self, op: BinaryOp, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        let dtypes = [self.dtype(), rhs.dtype()];
        let half = |d: DType| matches!(d, DType::BF16 | DType::F16);
        if !(dtypes.contains(&DType::F32) && dtypes.into_iter().any(half)) {
            return Err(Error::DTypeMismatch {
                op: op.name(),
                expected: self.dtype(),
                found: rhs.dtype(),
            });
        }
        let rt = self.runtime()?;
        let n = al.numel();
        let out = CudaStorage::alloc_on(rt, DType::F32, n)?;
        if n == 0 {
            return Ok(out);
        }
        let shape = KernelShape::new(op.name(), al.dims(), &[al.strides(), bl.strides()])?;
        let m = mode(&shape);
        let grid = if m == 3 {
            Grid::linear(rt, n, 256)
        } else {
            Grid::exact(n.div_ceil(4), 256)
        };
        let (a, b) = (self.dev_ptr(al), rhs.dev_ptr(bl));
        // `a` and `b` reach only elements inside their storages through `shape`'s strides
        // (valid layouts), `out` holds `n` elements.
        launch::binary_mixed(
            rt,
            op,
            &dtypes,
            grid,
            a,
            b,
            out.dev_ptr_mut_at(0),
            &shape,
            n as i64,
            m,
        )?;
        Ok(out)
    }

    /// Checks `op` on this dtype (the CPU backend's errors), and for integer pow enqueues the
    /// exponents' check.
    fn check_binary(&self, op: BinaryOp, rhs: &CudaStorage, bl: &Layout) -> Result<()> {
        same_dtype(op.name(), self, rhs)?;
        let dtype = self.dtype();
        match dtype {
            DType::Bool if op.bools() == Bools::No => Err(Error::UnsupportedDType {
                op: op.name(),
                dtype,
                hint: "use logical_xor / logical_not for booleans, or convert with to_dtype",
            }),
            DType::Bool => Ok(()),
            d if !d.is_floating_point() && op.ints() != Ints::Int => Err(Error::dtype(op.name(), d)),
            d if op == BinaryOp::Pow && !d.is_floating_point() && d != DType::U8 => {
                rhs.check_pow_exponents(bl)
            }
            _ => Ok(()),
        }
    }

    /// Enqueues `check_pow_exponent_I` over the integer exponents at `bl`: a negative one is
    /// reported at the next synchronizing call with the CPU's error (Note [Deferred device
    /// errors] in `device_errors.rs`), instead of reading the exponents back here.
    fn check_pow_exponents(&self, bl: &Layout) -> Result<()> {
        let n = bl.numel();
        if n == 0 {
            return Ok(());
        }
        let rt = self.runtime()?;
        let shape = KernelShape::new("pow", bl.dims(), &[bl.strides()])?;
        let check = rt.errors.check_args("pow", Kind::NegativePower, 0, 0);
        // `b` reaches the `n` elements of a valid layout; `check` addresses the device's
        // error record.
        launch::check_pow_exponent(
            rt,
            &[self.dtype()],
            Grid::linear(rt, n, 256),
            self.dev_ptr(bl),
            &shape,
            n as i64,
            &check,
        )
    }
}

impl ElementwiseOps for CudaStorage {
    /// `lhs op rhs` for two storages of one dtype, layouts broadcast to one shape.
    #[inline]
    fn binary(&self, op: BinaryOp, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        if self.dtype() != rhs.dtype() && op.line().promotion == Promotion::CommonMixed {
            return self.binary_mixed(op, al, rhs, bl);
        }
        self.check_binary(op, rhs, bl)?;
        self.two_operand(TwoOperand::Binary(op), al, rhs, bl, self.dtype())
    }

    /// `lhs op rhs` written into the contiguous `out` at `ol` (same dtype, shape `al`'s).
    #[inline]
    fn binary_into(
        &self,
        op: BinaryOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        out: &mut CudaStorage,
        ol: &Layout,
    ) -> Result<()> {
        self.check_binary(op, rhs, bl)?;
        same_dtype(op.name(), self, out)?;
        debug_assert!(ol.is_contiguous() && ol.numel() == al.numel());
        let rt = self.runtime()?;
        let (a, b) = (self.dev_ptr(al), rhs.dev_ptr(bl));
        launch_two(
            TwoOperand::Binary(op),
            self.dtype(),
            a,
            al,
            b,
            bl,
            out.dev_ptr_mut(ol),
            rt,
        )
    }

    /// `self op rhs` over `self`'s elements at `al` (row-major from its offset): the binary
    /// kernel with `self` as both the first operand and the output. Each element is read
    /// before it is written by the same thread, and no two indices share an element.
    fn binary_inplace(&mut self, op: BinaryOp, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<()> {
        self.check_binary(op, rhs, bl)?;
        if !al.is_contiguous() {
            return Err(Error::invalid(
                op.name(),
                "in-place binary kernels write a row-major destination; this is a bug",
            ));
        }
        let rt = self.runtime()?;
        let o = self.dev_ptr_mut(al);
        launch_two(
            TwoOperand::Binary(op),
            self.dtype(),
            o.read_only(),
            al,
            rhs.dev_ptr(bl),
            bl,
            o,
            rt,
        )
    }

    /// Elementwise comparison producing booleans.
    #[inline]
    fn compare(&self, op: CmpOp, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        same_dtype(op.name(), self, rhs)?;
        self.two_operand(TwoOperand::Compare(op), al, rhs, bl, DType::Bool)
    }

    /// Logical op on two boolean storages.
    #[inline]
    fn logical(&self, op: LogicalOp, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        for s in [self, rhs] {
            if s.dtype() != DType::Bool {
                return Err(Error::dtype(op.name(), s.dtype()));
            }
        }
        same_dtype(op.name(), self, rhs)?;
        self.two_operand(TwoOperand::Logical(op), al, rhs, bl, DType::Bool)
    }

    /// `cond ? a : b` elementwise; `self` is the boolean condition; all layouts share a shape.
    #[inline]
    fn where_cond(
        &self,
        cl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        if self.dtype() != DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "where",
                dtype: self.dtype(),
                hint: "the condition must be a bool tensor",
            });
        }
        same_dtype("where", a, b)?;
        if self.ordinal() != a.ordinal() {
            return Err(Error::DeviceMismatch {
                op: "where",
                lhs: self.device(),
                rhs: a.device(),
            });
        }
        let rt = self.runtime()?;
        let n = al.numel();
        let out = CudaStorage::alloc_on(rt, a.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        let shape = KernelShape::new("where", al.dims(), &[al.strides(), bl.strides(), cl.strides()])?;
        // Strides come from valid layouts of each storage, `out` holds `n` elements.
        launch::where_select(
            rt,
            &[a.dtype()],
            Grid::linear(rt, n, 256),
            self.dev_ptr(cl),
            a.dev_ptr(al),
            b.dev_ptr(bl),
            out.dev_ptr_mut_at(0),
            &shape,
            n as i64,
        )?;
        Ok(out)
    }
}
