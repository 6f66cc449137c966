//! TEMPORARY: CUDA arms of op families whose kernels are being written; each returns a typed
//! error. Removed as each family lands (index/random, unary, matmul).
//! error. Removed as each family lands (reduce/softmax, unary, matmul).
#![allow(unused_variables)]

use super::storage::CudaStorage;
use crate::layout::Layout;
use crate::ops::index::{IndexOp, ScatterOp};
use crate::ops::reduce::ReduceOp;
use crate::ops::softmax::SoftmaxOp;
use crate::ops::unary::UnaryOp;
use crate::{Error, Result};
use crate::random::dist::Distribution;
use crate::random::RngState;
use crate::{DType, Error, Result};

fn pending(op: &'static str) -> Error {
    Error::Cuda {
        op,
        msg: "not implemented on CUDA yet".into(),
    }
}

impl CudaStorage {
    pub(crate) fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        il: &Layout,
    ) -> Result<CudaStorage> {
        Err(pending("index"))
    }
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        il: &Layout,
        src: &CudaStorage,
        sl: &Layout,
    ) -> Result<CudaStorage> {
        Err(pending("index"))
    }
    pub(crate) fn one_hot(
        &self,
        layout: &Layout,
        num_classes: Option<usize>,
    ) -> Result<(CudaStorage, usize)> {
        Err(pending("one_hot"))
    }
    pub(crate) fn random(
        device: usize,
        dtype: DType,
        n: usize,
        dist: Distribution,
        state: RngState,
    ) -> Result<CudaStorage> {
        Err(pending("random"))
    }
    pub(crate) fn randperm(device: usize, n: usize, state: RngState) -> Result<CudaStorage> {
        Err(pending("randperm"))
    }
    pub(crate) fn bernoulli(&self, layout: &Layout, state: RngState) -> Result<CudaStorage> {
        Err(pending("bernoulli"))
    pub(crate) fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CudaStorage> {
        Err(pending("reduce"))
    pub(crate) fn reduce_with_indices(
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CudaStorage, CudaStorage)> {
    pub(crate) fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CudaStorage> {
        Err(pending("softmax"))
    pub(crate) fn softmax_backward(
        yl: &Layout,
        grad: &CudaStorage,
        gl: &Layout,
        op: SoftmaxOp,
    }
}
