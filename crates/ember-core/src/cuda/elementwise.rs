//! CUDA launchers for `kernels/elementwise.cu`: arithmetic, comparisons, logical ops and
//! `where` on operands whose layouts were already broadcast to one shape.

use super::device_errors::Kind;
use super::kernels::{launch, Grid, KernelKey, KernelShape, Module};
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::op::{BinaryOp, Bools, CmpOp, Ints, LogicalOp};
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

impl CudaStorage {
    /// Launches the two-operand kernel `key` (`binary`, `compare` or `logical` form) writing a
    /// new row-major storage of `out_dtype`.
    #[allow(clippy::too_many_arguments)]
    fn two_operand(
        &self,
        name: &'static str,
        key: KernelKey,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        out_dtype: DType,
    ) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let out = CudaStorage::alloc_on(rt, out_dtype, al.numel())?;
        self.two_operand_into(name, key, al, rhs, bl, out.ptr_at(0))?;
        Ok(out)
    }

    /// As `two_operand`, writing row-major into device memory at `o` (room for `al.numel()`
    /// elements of the output dtype, not overlapping either operand).
    #[allow(clippy::too_many_arguments)]
    fn two_operand_into(
        &self,
        name: &'static str,
        key: KernelKey,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        o: u64,
    ) -> Result<()> {
        let rt = self.runtime()?;
        let n = al.numel();
        if n == 0 {
            return Ok(());
        }
        let shape = KernelShape::new(name, al.dims(), &[al.strides(), bl.strides()])?;
        let f = rt.function(key)?;
        let (a, b) = (self.ptr(al), rhs.ptr(bl));
        let (n64, m) = (n as i64, mode(&shape));
        // The vectorized modes move 4 packs of 16 bytes per thread (elementwise.cu's UNROLL):
        // one thread per 4 packs, as many blocks as that takes, so no thread loops.
        let grid = if m == 3 {
            Grid::linear(rt, n, 256)
        } else {
            let per_thread = 4 * (16 / self.dtype().size_in_bytes()).min(16);
            Grid::exact(n.div_ceil(per_thread), 256)
        };
        // SAFETY: signature `(const T* a, const T* b, Out* out, Strided s, i64 n, i32 mode)`;
        // `a` and `b` reach only elements inside their storages through `shape`'s strides
        // (valid layouts), `out` holds `n` elements.
        unsafe { launch(f, grid, current_raw(rt.ordinal), &[&a, &b, &o, &shape, &n64, &m]) }
    }

    /// `lhs op rhs` for two storages of one dtype, layouts broadcast to one shape.
    pub(crate) fn binary(
        &self,
        op: BinaryOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        let key = self.binary_kernel(op, rhs, bl)?;
        self.two_operand(op.name(), key, al, rhs, bl, self.dtype())
    }

    /// `lhs op rhs` written into the contiguous `out` at `ol` (same dtype, shape `al`'s).
    pub(crate) fn binary_into(
        &self,
        op: BinaryOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
        out: &mut CudaStorage,
        ol: &Layout,
    ) -> Result<()> {
        let key = self.binary_kernel(op, rhs, bl)?;
        same_dtype(op.name(), self, out)?;
        debug_assert!(ol.is_contiguous() && ol.numel() == al.numel());
        self.two_operand_into(op.name(), key, al, rhs, bl, out.ptr(ol))
    }

    /// `self op rhs` over `self`'s elements at `al` (row-major from its offset): the binary
    /// kernel with `self` as both the first operand and the output. Each element is read
    /// before it is written by the same thread, and no two indices share an element.
    pub(crate) fn binary_inplace(
        &mut self,
        op: BinaryOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        let key = self.binary_kernel(op, rhs, bl)?;
        if !al.is_contiguous() {
            return Err(Error::invalid(
                op.name(),
                "in-place binary kernels write a row-major destination; this is a bug",
            ));
        }
        let o = self.ptr(al);
        self.two_operand_into(op.name(), key, al, rhs, bl, o)
    }

    /// The kernel of `op` on this dtype, or the CPU backend's error for it.
    fn binary_kernel(&self, op: BinaryOp, rhs: &CudaStorage, bl: &Layout) -> Result<KernelKey> {
        same_dtype(op.name(), self, rhs)?;
        let dtype = self.dtype();
        match dtype {
            DType::Bool if op.bools() == Bools::No => {
                return Err(Error::UnsupportedDType {
                    op: op.name(),
                    dtype,
                    hint: "use logical_xor / logical_not for booleans, or convert with to_dtype",
                })
            }
            DType::Bool => {}
            d if !d.is_floating_point() && op.ints() != Ints::Int => return Err(Error::dtype(op.name(), d)),
            d if op == BinaryOp::Pow && !d.is_floating_point() && d != DType::U8 => {
                rhs.check_pow_exponents(bl)?;
            }
            _ => {}
        }
        Ok(KernelKey::new(Module::Elementwise, op.kernel(), dtype))
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
        let f = rt.function(KernelKey::new(
            Module::Elementwise,
            "check_pow_exponent",
            self.dtype(),
        ))?;
        let (b, n64) = (self.ptr(bl), n as i64);
        let check = rt.errors.check_args("pow", Kind::NegativePower, 0, 0);
        // SAFETY: `check_pow_exponent_I(const I* b, Strided s, i64 n, ErrorCheck check)` with I
        // this storage's dtype (i64 or i32); `b` reaches the `n` elements of a valid layout;
        // `check` addresses the device's error record.
        unsafe {
            launch(
                f,
                Grid::linear(rt, n, 256),
                current_raw(rt.ordinal),
                &[&b, &shape, &n64, &check],
            )
        }
    }

    /// Elementwise comparison producing booleans.
    pub(crate) fn compare(
        &self,
        op: CmpOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        same_dtype(op.name(), self, rhs)?;
        let key = KernelKey::new(Module::Elementwise, op.kernel(), self.dtype());
        self.two_operand(op.name(), key, al, rhs, bl, DType::Bool)
    }

    /// Logical op on two boolean storages.
    pub(crate) fn logical(
        &self,
        op: LogicalOp,
        al: &Layout,
        rhs: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        for s in [self, rhs] {
            if s.dtype() != DType::Bool {
                return Err(Error::dtype(op.name(), s.dtype()));
            }
        }
        same_dtype(op.name(), self, rhs)?;
        let key = KernelKey::plain(Module::Elementwise, op.kernel());
        self.two_operand(op.name(), key, al, rhs, bl, DType::Bool)
    }

    /// `cond ? a : b` elementwise; `self` is the boolean condition; all layouts share a shape.
    pub(crate) fn where_cond(
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
        let f = rt.function(KernelKey::new(Module::Elementwise, "where", a.dtype()))?;
        let (c, ap, bp, o, n64) = (self.ptr(cl), a.ptr(al), b.ptr(bl), out.ptr_at(0), n as i64);
        // SAFETY: `where_T(const bool* c, const T* a, const T* b, T* out, Strided s, i64 n)`;
        // strides come from valid layouts of each storage, `out` holds `n` elements.
        unsafe {
            launch(
                f,
                Grid::linear(rt, n, 256),
                current_raw(rt.ordinal),
                &[&c, &ap, &bp, &o, &shape, &n64],
            )?;
        }
        Ok(out)
    }
}
