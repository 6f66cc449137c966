//! The CPU backend behind the backend boundary: [`CpuDevice`] and the [`BackendStorage`]
//! implementation of [`CpuStorage`]. Each method forwards to its family's kernels
//! (`cpu/<family>.rs`); most kernels are inherent methods of the same name, which Rust resolves
//! before the trait's (`CpuStorage::binary(self, ..)` below is the kernel, not a recursion).

use super::{conv, pool, random, CpuStorage};
use crate::backend::{
    BackendDevice, BackendStorage, BinaryOp, CmpOp, ConvParams, Distribution, IndexOp, LogicalOp,
    LstmBackwardStep, LstmForwardStep, PoolParams, ReduceOp, RngState, ScatterOp, SoftmaxOp, UnaryOp,
};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};

/// The host, as a backend device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDevice;

impl BackendDevice for CpuDevice {
    type Storage = CpuStorage;

    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<CpuStorage> {
        Ok(cpu)
    }

    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<CpuStorage> {
        CpuStorage::full(dtype, n, value).ok_or_else(|| {
            Error::invalid(
                "allocate",
                format!(
                    "cannot allocate {n} elements of {dtype} ({} bytes) in host memory; use a smaller shape",
                    n.saturating_mul(dtype.size_in_bytes())
                ),
            )
        })
    }

    fn alloc(&self, dtype: DType, n: usize) -> Result<CpuStorage> {
        self.full(dtype, n, 0.0)
    }

    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: RngState) -> Result<CpuStorage> {
        random::random(dtype, n, dist, state)
    }

    fn randperm(&self, n: usize, state: RngState) -> Result<CpuStorage> {
        Ok(random::randperm(n, state))
    }
}

impl BackendStorage for CpuStorage {
    #[inline]
    fn device(&self) -> Device {
        Device::Cpu
    }

    #[inline]
    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }

    #[inline]
    fn len(&self) -> usize {
        CpuStorage::len(self)
    }

    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<CpuStorage> {
        Ok(CpuStorage::to_dtype(self, layout, dtype))
    }

    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        Ok(self.contiguous(layout))
    }

    fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
    ) -> Result<()> {
        CpuStorage::copy_strided_from(self, dst_layout, src, src_layout);
        Ok(())
    }

    #[inline]
    fn binary(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::binary(self, op, layout, rhs, rhs_layout)
    }

    fn binary_into(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        out: &mut CpuStorage,
        out_layout: &Layout,
    ) -> Result<()> {
        // The kernels write new buffers; the result is copied into place.
        let r = CpuStorage::binary(self, op, layout, rhs, rhs_layout)?;
        CpuStorage::copy_strided_from(out, out_layout, &r, &Layout::contiguous(layout.shape().clone()));
        Ok(())
    }

    fn compare(
        &self,
        op: CmpOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::compare(self, op, layout, rhs, rhs_layout)
    }

    fn logical(
        &self,
        op: LogicalOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::logical(self, op, layout, rhs, rhs_layout)
    }

    fn where_cond(
        &self,
        layout: &Layout,
        on_true: &CpuStorage,
        true_layout: &Layout,
        on_false: &CpuStorage,
        false_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::where_cond(self, layout, on_true, true_layout, on_false, false_layout)
    }

    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CpuStorage> {
        CpuStorage::unary(self, op, layout)
    }

    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CpuStorage> {
        CpuStorage::reduce(self, layout, op, dims)
    }

    fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CpuStorage, CpuStorage)> {
        CpuStorage::reduce_with_indices(self, layout, op, dims)
    }

    fn matmul(&self, layout: &Layout, rhs: &CpuStorage, rhs_layout: &Layout) -> Result<CpuStorage> {
        CpuStorage::matmul(self, layout, rhs, rhs_layout)
    }

    fn matmul_bias(
        &self,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::matmul_bias(self, layout, rhs, rhs_layout, bias, bias_layout)
    }

    fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &CpuStorage,
        index_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::index_read(self, op, name, layout, dim, index, index_layout)
    }

    fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &CpuStorage,
        index_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
    ) -> Result<CpuStorage> {
        CpuStorage::index_write(self, op, layout, dim, index, index_layout, src, src_layout)
    }

    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(CpuStorage, usize)> {
        CpuStorage::one_hot(self, layout, num_classes)
    }

    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CpuStorage> {
        CpuStorage::softmax(self, layout, op, dim)
    }

    fn softmax_backward(
        &self,
        layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<CpuStorage> {
        CpuStorage::softmax_backward(self, layout, grad, grad_layout, op, dim)
    }

    fn bernoulli(&self, layout: &Layout, state: RngState) -> Result<CpuStorage> {
        random::bernoulli(self, layout, state)
    }

    fn conv_forward(&self, weight: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        conv::forward(self, weight, p)
    }

    fn conv_backward_data(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        conv::backward_data(self, grad_out, p)
    }

    fn conv_backward_filter(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        conv::backward_filter(self, grad_out, p)
    }

    fn pool_forward(&self, p: &PoolParams) -> Result<Option<CpuStorage>> {
        pool::forward(self, p)
    }

    fn pool_backward(
        &self,
        _output: &CpuStorage,
        grad_out: &CpuStorage,
        p: &PoolParams,
    ) -> Result<Option<CpuStorage>> {
        pool::backward(self, grad_out, p)
    }

    fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &CpuStorage,
        hh: &CpuStorage,
        h: &mut CpuStorage,
        c: &mut CpuStorage,
        gates: &mut CpuStorage,
    ) -> Result<()> {
        CpuStorage::lstm_forward_step(s, gi, hh, h, c, gates)
    }

    fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &CpuStorage,
        dh_rec: Option<&CpuStorage>,
        gates: &CpuStorage,
        c: &CpuStorage,
        dc: &mut CpuStorage,
        dgates: &mut CpuStorage,
    ) -> Result<()> {
        CpuStorage::lstm_backward_step(s, dh_out, dh_rec, gates, c, dc, dgates)
    }
}

// ---------------------------------------------------------------------------------------------
// Fused optimizer steps: the backend-neutral description to `cpu/optim.rs`'s kernels.
