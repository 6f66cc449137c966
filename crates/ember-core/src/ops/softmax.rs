//! Softmax and log_softmax along one dim, with their closed-form backward (a kernel of its
//! own, from the saved output): softmax `y (g - Σ g y)`, log_softmax `g - exp(y) Σ g`.

use super::binary::same_device;
use crate::autograd::SavedTensor;
use crate::dispatch::{self, policy};
use crate::{Error, Result, Tensor};

pub use crate::backend::op::SoftmaxOp;

fn softmax(x: &Tensor, op: SoftmaxOp, dim: isize) -> Result<Tensor> {
    let line = match op {
        SoftmaxOp::Softmax => &policy::SOFTMAX,
        SoftmaxOp::LogSoftmax => &policy::LOG_SOFTMAX,
    };
    let d = x.shape().dim(op.name(), dim)?;
    dispatch::call(
        line,
        [x],
        |[x], door| {
            if !x.dtype().is_floating_point() {
                return Err(Error::UnsupportedDType {
                    op: op.name(),
                    dtype: x.dtype(),
                    hint: "it needs a floating point input; convert with .to_dtype(DType::F32) first",
                });
            }
            let storage = x.storage().read().softmax(x.layout(), op, d)?;
            Ok(door.tensor(storage, x.shape().clone()))
        },
        |_, out, door| {
            let y = SavedTensor::new(op.name(), out);
            Ok(move |g: &Tensor, _: &[bool]| {
                let y = y.get()?;
                same_device(op.name(), &[y, g])?;
                let g = g.to_dtype(y.dtype())?;
                let storage = y.storage().read().softmax_backward(
                    y.layout(),
                    &g.storage().read(),
                    g.layout(),
                    op,
                    d,
                )?;
                Ok(vec![Some(door.tensor(storage, y.shape().clone()))])
            })
        },
    )
}

impl Tensor {
    /// `exp(x) / Σ exp(x)` along `dim`, computed stably (floating point inputs only).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        softmax(self, SoftmaxOp::Softmax, dim)
    }

    /// `x - log Σ exp(x)` along `dim`, computed stably (floating point inputs only).
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        softmax(self, SoftmaxOp::LogSoftmax, dim)
    }
}
