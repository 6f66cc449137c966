//! TEMPORARY: CUDA arms of op families whose kernels are being written; each returns a typed
//! error. Removed as each family lands (reduce/softmax, unary, matmul).
#![allow(unused_variables)]

use super::storage::CudaStorage;
use crate::layout::Layout;
use crate::ops::reduce::ReduceOp;
use crate::ops::softmax::SoftmaxOp;
use crate::ops::unary::UnaryOp;
use crate::{Error, Result};

fn pending(op: &'static str) -> Error {
    Error::Cuda {
        op,
        msg: "not implemented on CUDA yet".into(),
    }
}

impl CudaStorage {
    pub(crate) fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CudaStorage> {
        Err(pending("reduce"))
    }
    pub(crate) fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CudaStorage, CudaStorage)> {
        Err(pending("reduce"))
    }
    pub(crate) fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CudaStorage> {
        Err(pending("softmax"))
    }
    pub(crate) fn softmax_backward(
        &self,
        yl: &Layout,
        grad: &CudaStorage,
        gl: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<CudaStorage> {
        Err(pending("softmax"))
    }
    pub(crate) fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CudaStorage> {
        Err(pending("unary"))
    }
    pub(crate) fn matmul(&self, al: &Layout, rhs: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
        Err(pending("matmul"))
    }
}
