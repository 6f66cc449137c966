//! The CUDA backend behind the backend boundary: [`CudaDevice`] and the [`BackendStorage`]
//! implementation of [`CudaStorage`]. Each method forwards to its family's launcher
//! (`cuda/<family>.rs`); most launchers are inherent methods of the same name, which Rust
//! resolves before the trait's (`CudaStorage::binary(self, ..)` below is the launcher, not a
//! recursion).
//!
//! Convolution and pooling run through cuDNN and answer `None` (so that the op layer takes its
//! composite path) where cuDNN cannot be loaded, is switched off
//! ([`crate::backends::cudnn::set_enabled`]), or cannot take the problem (`cudnn::supported`).
//! The switch is read by the forward calls only: the backward of a problem cuDNN ran forward
//! runs on cuDNN too, as in PyTorch.

use super::launch::{DevPtr, DevPtrMut};
use super::multi_copy::{multi_copy, ByteCopy};
use super::optim::{
    multi_tensor_step, multi_tensor_step_arriving, Arrival, OptimKernel, OptimTensor, ADAM_DEVICE_STEPS,
};
use super::{amp, cudnn, cudnn_pool, CudaStorage};
use crate::backend::{
    AdamStep, AdamTensor, AmpOps, BackendDevice, BackendStorage, BinaryOp, CmpOp, ConvOps, ConvParams,
    CopyOps, Distribution, ElementwiseOps, Elems, ForeachCopy, GradElems, IndexOp, IndexOps, LogicalOp,
    LossOps, LstmBackwardStep, LstmForwardStep, MatmulOps, OptimOps, PhiloxState, PoolOps, PoolParams,
    RandomOps, ReduceOp, ReduceOps, RngState, RnnOps, ScaleUpdate, ScatterOp, SgdStep, SgdTensor, SoftmaxOp,
    SoftmaxOps, StepCount, StepScalars, UnaryOp, UnaryOps, UnscaleGrads,
};
use crate::cpu::CpuStorage;
use crate::layout::Layout;
use crate::{DType, Device, Result};
use std::ops::Deref;

/// GPU `.0` (its ordinal), as a backend device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDevice(pub usize);

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;

    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<CudaStorage> {
        CudaStorage::from_cpu(&cpu, self.0)
    }

    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<CudaStorage> {
        CudaStorage::full(self.0, dtype, n, value)
    }

    fn alloc(&self, dtype: DType, n: usize) -> Result<CudaStorage> {
        CudaStorage::alloc(self.0, dtype, n)
    }

    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: PhiloxState) -> Result<CudaStorage> {
        CudaStorage::random(self.0, dtype, n, dist, state)
    }

    fn randperm(&self, n: usize, state: RngState) -> Result<CudaStorage> {
        CudaStorage::randperm(self.0, n, state)
    }
}

/// Whether cuDNN may run convolutions and pooling now (loadable and switched on).
fn cudnn_on() -> bool {
    cudnn::enabled() && cudnn::is_available()
}

impl BackendStorage for CudaStorage {
    #[inline]
    fn device(&self) -> Device {
        CudaStorage::device(self)
    }

    #[inline]
    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }

    #[inline]
    fn len(&self) -> usize {
        CudaStorage::len(self)
    }
}

impl CopyOps for CudaStorage {
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<CudaStorage> {
        CudaStorage::to_dtype(self, layout, dtype)
    }

    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        CudaStorage::to_cpu(self, layout)
    }

    fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
    ) -> Result<()> {
        CudaStorage::copy_strided_from(self, dst_layout, src, src_layout)
    }

    fn foreach_copy(list: ForeachCopy<'_, CudaStorage>) -> Result<()> {
        let Some(first) = list.written.first() else {
            return Ok(());
        };
        let ordinal = first.ordinal();
        if let Some(other) = list
            .written
            .iter()
            .map(|s| s.ordinal())
            .chain(list.read.iter().map(|s| s.ordinal()))
            .find(|&o| o != ordinal)
        {
            return Err(crate::Error::DeviceMismatch {
                op: "_foreach_copy_",
                lhs: Device::Cuda(ordinal),
                rhs: Device::Cuda(other),
            });
        }
        let copies: Vec<ByteCopy> = list
            .copies
            .iter()
            .map(|(d, s)| {
                let dst = &list.written[d.storage];
                ByteCopy {
                    dst: dst.ptr_at(d.offset),
                    src: list.read[s.storage].ptr_at(s.offset),
                    bytes: d.len * dst.dtype().size_in_bytes(),
                }
            })
            .collect();
        let _device = super::DeviceGuard::new(ordinal)?;
        // SAFETY: each run lies inside its storage (`ForeachCopy::check`), the written storages
        // are borrowed mutably and the read ones shared for the call, all on device `ordinal`;
        // no two written runs overlap and no storage is both written and read (the list's
        // contract); the storages are freed through the caching allocator, in stream order.
        unsafe { multi_copy(ordinal, &copies) }
    }
}

impl ElementwiseOps for CudaStorage {
    #[inline]
    fn binary(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::binary(self, op, layout, rhs, rhs_layout)
    }

    #[inline]
    fn binary_into(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
        out: &mut CudaStorage,
        out_layout: &Layout,
    ) -> Result<()> {
        CudaStorage::binary_into(self, op, layout, rhs, rhs_layout, out, out_layout)
    }

    fn binary_inplace(
        &mut self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
    ) -> Result<()> {
        CudaStorage::binary_inplace(self, op, layout, rhs, rhs_layout)
    }

    #[inline]
    fn compare(
        &self,
        op: CmpOp,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::compare(self, op, layout, rhs, rhs_layout)
    }

    #[inline]
    fn logical(
        &self,
        op: LogicalOp,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::logical(self, op, layout, rhs, rhs_layout)
    }

    #[inline]
    fn where_cond(
        &self,
        layout: &Layout,
        on_true: &CudaStorage,
        true_layout: &Layout,
        on_false: &CudaStorage,
        false_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::where_cond(self, layout, on_true, true_layout, on_false, false_layout)
    }
}

impl UnaryOps for CudaStorage {
    #[inline]
    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CudaStorage> {
        CudaStorage::unary(self, op, layout)
    }

    fn relu_backward(&self, grad_out: &CudaStorage, len: usize) -> Result<Option<CudaStorage>> {
        if !cudnn_on() {
            return Ok(None);
        }
        cudnn::relu_backward(self, grad_out, len)
    }
}

impl ReduceOps for CudaStorage {
    #[inline]
    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CudaStorage> {
        CudaStorage::reduce(self, layout, op, dims)
    }

    fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CudaStorage, CudaStorage)> {
        CudaStorage::reduce_with_indices(self, layout, op, dims)
    }
}

impl MatmulOps for CudaStorage {
    #[inline]
    fn matmul(&self, layout: &Layout, rhs: &CudaStorage, rhs_layout: &Layout) -> Result<CudaStorage> {
        CudaStorage::matmul(self, layout, rhs, rhs_layout)
    }

    fn matmul_bias(
        &self,
        layout: &Layout,
        rhs: &CudaStorage,
        rhs_layout: &Layout,
        bias: &CudaStorage,
        bias_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::matmul_bias(self, layout, rhs, rhs_layout, bias, bias_layout)
    }
}

impl IndexOps for CudaStorage {
    fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        index_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::index_read(self, op, name, layout, dim, index, index_layout)
    }

    fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        index_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
    ) -> Result<CudaStorage> {
        CudaStorage::index_write(self, op, layout, dim, index, index_layout, src, src_layout)
    }

    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(CudaStorage, usize)> {
        CudaStorage::one_hot(self, layout, num_classes)
    }
}

impl SoftmaxOps for CudaStorage {
    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CudaStorage> {
        CudaStorage::softmax(self, layout, op, dim)
    }

    fn softmax_backward(
        &self,
        layout: &Layout,
        grad: &CudaStorage,
        grad_layout: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<CudaStorage> {
        CudaStorage::softmax_backward(self, layout, grad, grad_layout, op, dim)
    }
}

impl RandomOps for CudaStorage {
    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<CudaStorage> {
        CudaStorage::bernoulli(self, layout, state)
    }
}

impl LossOps for CudaStorage {
    fn nll_loss_forward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CudaStorage, CudaStorage)> {
        CudaStorage::nll_loss_forward(self, target, weight, mc, ignore_index, mean)
    }

    fn nll_loss_backward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        total_weight: &CudaStorage,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CudaStorage> {
        CudaStorage::nll_loss_backward(self, target, weight, total_weight, mc, ignore_index, mean)
    }
}

impl ConvOps for CudaStorage {
    fn conv_forward(&self, weight: &CudaStorage, p: &ConvParams) -> Result<Option<CudaStorage>> {
        if !cudnn_on() || !cudnn::supported(p) {
            return Ok(None);
        }
        cudnn::conv_forward(self, weight, p).map(Some)
    }

    fn conv_backward_data(&self, grad_out: &CudaStorage, p: &ConvParams) -> Result<Option<CudaStorage>> {
        if !cudnn::is_available() || !cudnn::supported(p) {
            return Ok(None);
        }
        cudnn::conv_backward_data(self, grad_out, p).map(Some)
    }

    fn conv_backward_filter(&self, grad_out: &CudaStorage, p: &ConvParams) -> Result<Option<CudaStorage>> {
        if !cudnn::is_available() || !cudnn::supported(p) {
            return Ok(None);
        }
        cudnn::conv_backward_filter(self, grad_out, p).map(Some)
    }

    fn conv_bias_add(&self, bias: &CudaStorage, p: &ConvParams) -> Result<bool> {
        if !cudnn_on() || !cudnn::supported(p) {
            return Ok(false);
        }
        cudnn::conv_bias_add(self, bias, p)
    }
}

impl PoolOps for CudaStorage {
    fn pool_forward(&self, p: &PoolParams) -> Result<Option<CudaStorage>> {
        if !cudnn_on() || !cudnn_pool::supported(p) {
            return Ok(None);
        }
        cudnn_pool::pool_forward(self, p)
    }

    fn pool_backward(
        &self,
        output: &CudaStorage,
        grad_out: &CudaStorage,
        p: &PoolParams,
    ) -> Result<Option<CudaStorage>> {
        if !cudnn::is_available() || !cudnn_pool::supported(p) {
            return Ok(None);
        }
        cudnn_pool::pool_backward(self, output, grad_out, p).map(Some)
    }
}

impl RnnOps for CudaStorage {
    fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &CudaStorage,
        hh: &CudaStorage,
        h: &mut CudaStorage,
        c: &mut CudaStorage,
        gates: &mut CudaStorage,
    ) -> Result<()> {
        CudaStorage::lstm_forward_step(s, gi, hh, h, c, gates)
    }

    fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &CudaStorage,
        dh_rec: Option<&CudaStorage>,
        gates: &CudaStorage,
        c: &CudaStorage,
        dc: &mut CudaStorage,
        dgates: &mut CudaStorage,
    ) -> Result<()> {
        CudaStorage::lstm_backward_step(s, dh_out, dh_rec, gates, c, dc, dgates)
    }
}

impl OptimOps for CudaStorage {
    fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, CudaStorage>>,
        amp: StepScalars<'_, CudaStorage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let (ordinal, dtype) = (first.param.storage.ordinal(), first.param.storage.dtype());
        let device_steps = matches!(first.step, StepCount::Device(_));
        let list: Vec<OptimTensor> = tensors
            .iter()
            .map(|t| OptimTensor {
                ptrs: [
                    Some(ptr_mut(&t.param)),
                    Some(grad_ptr(&t.grad)),
                    Some(ptr_mut(&t.exp_avg)),
                    Some(ptr_mut(&t.exp_avg_sq)),
                    t.max_exp_avg_sq.as_ref().map(ptr_mut),
                    match &t.step {
                        StepCount::Device(c) => Some(ptr_mut(c)),
                        StepCount::Host(_) => None,
                    },
                ],
                numel: t.param.len,
                scalars: match t.step {
                    StepCount::Host(n) => step.bias_correction_terms(n),
                    StepCount::Device(_) => [0.0; 2],
                },
            })
            .collect();
        let flags = step.amsgrad as i32
            | (step.maximize as i32) << 1
            | (step.decoupled_weight_decay as i32) << 2
            | if device_steps { ADAM_DEVICE_STEPS } else { 0 };
        let kernel = OptimKernel::Adam {
            lr: step.lr,
            beta1: step.beta1,
            one_minus_beta1: 1.0 - step.beta1,
            beta2: step.beta2,
            one_minus_beta2: 1.0 - step.beta2,
            eps: step.eps,
            weight_decay: step.weight_decay,
            grad_scale: amp.grad_scale.as_ref().map(ptr),
            found_inf: amp.found_inf.as_ref().map(ptr),
            lr_ptr: amp.lr.as_ref().map(ptr),
            flags,
        };
        let arrivals: Vec<Arrival<'_>> = tensors
            .iter()
            .enumerate()
            .flat_map(|(tensor, t)| {
                t.arrivals.iter().map(move |a| Arrival {
                    tensor,
                    elements: a.elements.clone(),
                    event: &a.event,
                    order: a.order,
                })
            })
            .collect();
        // The operands stay borrowed (their storages locked) until every launch is enqueued.
        multi_tensor_step_arriving(ordinal, dtype, &list, &arrivals, kernel)
    }

    fn sgd_step(
        step: &SgdStep,
        tensors: Vec<SgdTensor<'_, CudaStorage>>,
        amp: StepScalars<'_, CudaStorage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let (ordinal, dtype) = (first.param.storage.ordinal(), first.param.storage.dtype());
        let list: Vec<OptimTensor> = tensors
            .iter()
            .map(|t| OptimTensor {
                ptrs: [
                    Some(ptr_mut(&t.param)),
                    Some(grad_ptr(&t.grad)),
                    t.momentum_buffer.as_ref().map(ptr_mut),
                    None,
                    None,
                    None,
                ],
                numel: t.param.len,
                scalars: [0.0; 2],
            })
            .collect();
        let flags = step.nesterov as i32 | (step.maximize as i32) << 1 | (step.first_step as i32) << 2;
        let kernel = OptimKernel::Sgd {
            lr: step.lr,
            momentum: step.momentum,
            one_minus_dampening: 1.0 - step.dampening,
            weight_decay: step.weight_decay,
            grad_scale: amp.grad_scale.as_ref().map(ptr),
            found_inf: amp.found_inf.as_ref().map(ptr),
            lr_ptr: amp.lr.as_ref().map(ptr),
            flags,
        };
        multi_tensor_step(ordinal, dtype, &list, kernel)
    }
}

impl AmpOps for CudaStorage {
    fn non_finite_check_and_unscale(
        grads: UnscaleGrads<'_, CudaStorage>,
        found_inf: Elems<&mut CudaStorage>,
        inv_scale: Elems<&CudaStorage>,
    ) -> Result<()> {
        let ordinal = found_inf.storage.ordinal();
        let (found_ptr, inv_ptr) = (ptr_mut(&found_inf), ptr(&inv_scale));
        // One multi-tensor kernel per dtype, in this order.
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let group: Vec<(DevPtrMut<'_>, usize)> = grads
                .grads
                .iter()
                .map(|g| (&*grads.storages[g.storage], g))
                .filter(|(s, _)| s.dtype() == dtype)
                .map(|(s, g)| (s.dev_ptr_mut_at(g.offset), g.len))
                .collect();
            if !group.is_empty() {
                amp::non_finite_check_and_unscale(ordinal, dtype, &group, found_ptr, inv_ptr)?;
            }
        }
        Ok(())
    }

    fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut CudaStorage>,
        growth_tracker: Elems<&mut CudaStorage>,
        found_inf: Elems<&CudaStorage>,
    ) -> Result<()> {
        amp::update_scale(
            scale.storage.ordinal(),
            [ptr_mut(&scale), ptr_mut(&growth_tracker)],
            ptr(&found_inf),
            u.growth_factor,
            u.backoff_factor,
            u.growth_interval,
        )
    }
}

/// An operand's first element, read by the kernel.
fn ptr<S: Deref<Target = CudaStorage>>(e: &Elems<S>) -> DevPtr<'_> {
    e.storage.dev_ptr_at(e.offset)
}

/// An operand's first element, written by the kernel.
fn ptr_mut<S: Deref<Target = CudaStorage>>(e: &Elems<S>) -> DevPtrMut<'_> {
    e.storage.dev_ptr_mut_at(e.offset)
}

/// A gradient's first element (read, or written back unscaled with a grad scale).
fn grad_ptr<'a>(g: &'a GradElems<'_, CudaStorage>) -> DevPtrMut<'a> {
    match g {
        GradElems::Read(e) => ptr_mut(e),
        GradElems::Unscaled(e) => ptr_mut(e),
    }
}
