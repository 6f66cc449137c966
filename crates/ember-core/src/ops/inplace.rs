//! In-place ops (`add_`, `mul_`, `copy_`, `zero_`, `fill_`, ...): they write through to the
//! shared storage, so every view of it sees the change, and bump its version counter, so
//! autograd detects a saved tensor that was modified (see Note [Saved tensors] in `autograd`).
//!
//! Note [In-place and autograd]: as in PyTorch, an in-place op on a leaf that requires grad is
//! an error while grad mode is on (optimizers update parameters under `no_grad`). PyTorch also
//! rebases the graph of a non-leaf modified in place; ember does not yet, and says so with an
//! error instead of computing a wrong gradient.

use crate::autograd;
use crate::backend::op::BinaryOp;
use crate::dispatch::{self, policy};
use crate::dtype::Scalar;
use crate::ops::binary;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Checks that `self` may be written in place by `op` and that no graph is being recorded
    /// through the write.
    fn check_inplace(&self, op: &'static str, others: &[&Tensor]) -> Result<()> {
        if autograd::is_grad_enabled() {
            if self.requires_grad() && self.is_leaf() {
                return Err(Error::Autograd(format!(
                    "a leaf tensor that requires grad is being used in an in-place operation ({op}); wrap the update in no_grad()"
                )));
            }
            if self.requires_grad() || others.iter().any(|t| t.requires_grad()) {
                return Err(Error::Autograd(format!(
                    "in-place {op} on tensors that take part in autograd is not supported; use the out-of-place op, or no_grad()"
                )));
            }
        }
        // An empty tensor has no elements to overlap (its contiguous strides hold zeros).
        let overlapping = self.numel() > 0
            && self
                .dims()
                .iter()
                .zip(self.stride())
                .any(|(&d, &s)| d > 1 && s == 0);
        if overlapping {
            return Err(Error::invalid(
                op,
                "more than one element of the written-to tensor refers to a single memory location; call contiguous() first",
            ));
        }
        Ok(())
    }

    /// Writes `src` (broadcast to `self`'s shape, converted to `self`'s dtype and device) into
    /// `self`'s elements.
    fn write_from(&self, op: &'static str, src: &Tensor) -> Result<()> {
        let shape = self.shape().broadcast(src.shape(), op)?;
        if &shape != self.shape() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: self.shape().clone(),
                rhs: src.shape().clone(),
                hint: "the source must broadcast to the destination's shape",
            });
        }
        // A source over the same storage is materialized first: the write lock excludes reads.
        let src = if src.shares_storage_with(self) {
            let _g = autograd::no_grad();
            src.deep_clone()?
        } else {
            src.clone()
        };
        let src_layout = src.layout().broadcast_as(self.shape(), op)?;
        let src_storage = src.storage().read();
        self.storage()
            .write()
            .copy_strided_from(self.layout(), &src_storage, &src_layout)
    }

    /// Writes the result of an out-of-place op into `self`, refusing a dtype that would narrow
    /// (float result into an integer tensor), as PyTorch does.
    fn assign_result(&self, op: &'static str, result: &Tensor) -> Result<Tensor> {
        if result.dtype().is_floating_point() && !self.dtype().is_floating_point() {
            return Err(Error::invalid(
                op,
                format!(
                    "result type {} can't be cast to the desired output type {}",
                    result.dtype(),
                    self.dtype()
                ),
            ));
        }
        self.write_from(op, result)?;
        Ok(self.clone())
    }

    /// Copies `src` into `self` (broadcasting, converting dtype and device); returns `self`.
    pub fn copy_(&self, src: &Tensor) -> Result<Tensor> {
        // Only the destination enters the dispatch point: the source may be on another device.
        dispatch::call_with(&policy::COPY_, [self], |[_], _| self.copy_from(src))
    }

    fn copy_from(&self, src: &Tensor) -> Result<Tensor> {
        self.check_inplace("copy_", &[src])?;
        if src.device() != self.device() {
            let moved = src.to(self.device())?;
            self.write_from("copy_", &moved)?;
        } else {
            self.write_from("copy_", src)?;
        }
        Ok(self.clone())
    }

    /// Sets every element to `value`; returns `self`.
    pub fn fill_(&self, value: impl Into<Scalar>) -> Result<Tensor> {
        let value = value.into();
        dispatch::call_with(&policy::FILL_, [self], |[_], _| self.fill_with(value))
    }

    fn fill_with(&self, value: Scalar) -> Result<Tensor> {
        self.check_inplace("fill_", &[])?;
        let v = Tensor::scalar(value.to_f64(), self.dtype(), self.device())?;
        self.write_from("fill_", &v)?;
        Ok(self.clone())
    }

    /// Sets every element to zero; returns `self`.
    pub fn zero_(&self) -> Result<Tensor> {
        dispatch::named(&policy::ZERO_, &[self], || self.fill_(0.0))
    }

    /// `self += alpha * other`, the optimizer form of `add_(other, alpha=...)`: `alpha * other`
    /// in a new buffer, then added over `self` as `add_` does (one kernel where `self` is
    /// row-major and of the sum's dtype). PyTorch multiplies inside its one kernel.
    pub fn add_scaled_(&self, other: &Tensor, alpha: f64) -> Result<Tensor> {
        if alpha == 1.0 {
            return self.add_(other);
        }
        dispatch::named_kernel(BinaryOp::Add.inplace_line(), &[self, other], |_| {
            self.check_inplace("add_", &[other])?;
            let _g = autograd::no_grad();
            self.binary_past_dispatch(BinaryOp::Add, &other.mul_scalar(alpha)?)
        })
    }

    /// `self += value * t1 * t2` (`addcmul_`).
    pub fn addcmul_(&self, t1: &Tensor, t2: &Tensor, value: f64) -> Result<Tensor> {
        dispatch::named(&policy::ADDCMUL_, &[self, t1, t2], || {
            self.check_inplace("addcmul_", &[t1, t2])?;
            let _g = autograd::no_grad();
            let r = self.add(&t1.mul(t2)?.mul_scalar(value)?)?;
            self.assign_result("addcmul_", &r)
        })
    }

    /// `self += value * t1 / t2` (`addcdiv_`).
    pub fn addcdiv_(&self, t1: &Tensor, t2: &Tensor, value: f64) -> Result<Tensor> {
        dispatch::named(&policy::ADDCDIV_, &[self, t1, t2], || {
            self.check_inplace("addcdiv_", &[t1, t2])?;
            let _g = autograd::no_grad();
            let r = self.add(&t1.div(t2)?.mul_scalar(value)?)?;
            self.assign_result("addcdiv_", &r)
        })
    }

    /// Linear interpolation in place: `self += weight * (end - self)` (`lerp_`).
    pub fn lerp_(&self, end: &Tensor, weight: f64) -> Result<Tensor> {
        self.check_inplace("lerp_", &[end])?;
        // As PyTorch: `end` of the same dtype (no promotion), and a floating point one.
        if end.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: "lerp_",
                expected: self.dtype(),
                found: end.dtype(),
            });
        }
        if !self.dtype().is_floating_point() {
            return Err(Error::UnsupportedDType {
                op: "lerp_",
                dtype: self.dtype(),
                hint: "lerp needs floating point tensors",
            });
        }
        dispatch::named(&policy::LERP_, &[self, end], || {
            let _g = autograd::no_grad();
            let r = self.add(&end.sub(self)?.mul_scalar(weight)?)?;
            self.assign_result("lerp_", &r)
        })
    }

    /// Clamps in place (`clamp_`).
    pub fn clamp_(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        dispatch::named(&policy::CLAMP_, &[self], || {
            self.check_inplace("clamp_", &[])?;
            let _g = autograd::no_grad();
            let r = self.clamp(min, max)?;
            self.assign_result("clamp_", &r)
        })
    }
}

impl Tensor {
    /// `self op other` written over `self` (`add_`, `mul_`, ...): through the dispatch point
    /// under the op's in-place name. Where the op computes in `self`'s dtype and `self` is
    /// row-major, one kernel reads and writes `self` and nothing is allocated (PyTorch's
    /// `add_`); otherwise the out-of-place result is written back.
    pub(crate) fn binary_(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        dispatch::call_with(op.inplace_line(), [self, other], |_, _| {
            self.binary_past_dispatch(op, other)
        })
    }

    /// [`Tensor::binary_`] past the dispatch point, whose caller waited for what still writes
    /// `self` and `other` (step 1b).
    fn binary_past_dispatch(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        let name = op.inplace_line().name;
        self.check_inplace(name, &[other])?;
        let dtype = binary::result_dtype(op, self.dtype(), other.dtype());
        let direct = dtype == self.dtype() && self.is_contiguous() && !other.shares_storage_with(self);
        if !direct {
            let _g = autograd::no_grad();
            return self.assign_result(name, &binary::binary(op, self, other)?);
        }
        let other = other.to_dtype(dtype)?;
        if &self.shape().broadcast(other.shape(), name)? != self.shape() {
            return Err(Error::ShapeMismatch {
                op: name,
                lhs: self.shape().clone(),
                rhs: other.shape().clone(),
                hint: "the other operand must broadcast to the destination's shape",
            });
        }
        let bl = other.layout().broadcast_as(self.shape(), name)?;
        let rhs = other.storage().read();
        self.storage()
            .write()
            .binary_inplace(op, self.layout(), &rhs, &bl)?;
        Ok(self.clone())
    }

    /// `self op value` written over `self` (`add_scalar_`). A float `self` on a GPU, row-major,
    /// whose dtype the op computes in, is read and written by the scalar op's one kernel, with
    /// nothing allocated (PyTorch's `mul_(0.5)`); otherwise the out-of-place scalar op's result
    /// is written back (a new buffer and a copy).
    pub(crate) fn binary_scalar_(&self, op: BinaryOp, value: Scalar) -> Result<Tensor> {
        let name = op.inplace_line().name;
        dispatch::call_with(op.inplace_line(), [self], |_, _| {
            self.check_inplace(name, &[])?;
            let direct = binary::scalar_unary(op, self.dtype(), value).filter(|&(_, dtype)| {
                dtype == self.dtype() && self.device().is_cuda() && self.is_contiguous()
            });
            if let Some((unary, _)) = direct {
                if self.storage().write().unary_inplace(unary, self.layout())? {
                    return Ok(self.clone());
                }
            }
            let _g = autograd::no_grad();
            let r = binary::binary_scalar(op, self, value)?;
            self.assign_result(name, &r)
        })
    }
}
