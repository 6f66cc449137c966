//! Softmax and log_softmax along one dim, with their closed-form backward (a kernel of its
//! own, from the saved output): softmax `y (g - Σ g y)`, log_softmax `g - exp(y) Σ g`.

use super::binary::same_device;
use crate::autograd::SavedTensor;
use crate::dispatch::{self, policy};
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{Error, Result, Tensor};

/// Which normalization along a dim, as the backends see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoftmaxOp {
    Softmax,
    LogSoftmax,
}

impl SoftmaxOp {
    /// PyTorch's name of the op, as errors report it.
    pub fn name(self) -> &'static str {
        match self {
            SoftmaxOp::Softmax => "softmax",
            SoftmaxOp::LogSoftmax => "log_softmax",
        }
    }
}

impl Storage {
    /// `op` along `dim` of `layout`, as a row-major storage of the same shape.
    pub(crate) fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.softmax(layout, op, dim)?)),
            Storage::Cuda(s) => Ok(Storage::Cuda(s.softmax(layout, op, dim)?)),
        }
    }

    /// The input gradient of `op` along `dim` from its output (`self`) and output gradient.
    pub(crate) fn softmax_backward(
        &self,
        yl: &Layout,
        grad: &Storage,
        gl: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<Storage> {
        match (self, grad) {
            (Storage::Cpu(y), Storage::Cpu(g)) => Ok(Storage::Cpu(y.softmax_backward(yl, g, gl, op, dim)?)),
            (Storage::Cuda(y), Storage::Cuda(g)) => {
                Ok(Storage::Cuda(y.softmax_backward(yl, g, gl, op, dim)?))
            }
            (y, g) => Err(crate::ops::binary::mixed(op.name(), y, g)),
        }
    }
}

fn softmax(x: &Tensor, op: SoftmaxOp, dim: isize) -> Result<Tensor> {
    let line = match op {
        SoftmaxOp::Softmax => &policy::SOFTMAX,
        SoftmaxOp::LogSoftmax => &policy::LOG_SOFTMAX,
    };
    let d = x.shape().dim(op.name(), dim)?;
    dispatch::call(
        line,
        [x],
        |[x]| {
            if !x.dtype().is_floating_point() {
                return Err(Error::UnsupportedDType {
                    op: op.name(),
                    dtype: x.dtype(),
                    hint: "it needs a floating point input; convert with .to_dtype(DType::F32) first",
                });
            }
            let storage = x.storage().read().softmax(x.layout(), op, d)?;
            Ok(Tensor::from_storage(storage, x.shape().clone()))
        },
        |_, out| {
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
                Ok(vec![Some(Tensor::from_storage(storage, y.shape().clone()))])
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
