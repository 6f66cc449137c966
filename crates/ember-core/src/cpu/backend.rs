//! The CPU backend behind the backend boundary: [`CpuDevice`] and the [`BackendStorage`]
//! implementation of [`CpuStorage`]. Each method forwards to its family's kernels
//! (`cpu/<family>.rs`); most kernels are inherent methods of the same name, which Rust resolves
//! before the trait's (`CpuStorage::binary(self, ..)` below is the kernel, not a recursion).

use super::optim::{AdamScalars, AdamSlices, GradIn, OptimElement, SgdScalars, SgdSlices};
use super::{amp, conv, optim, pool, random, unary, CpuElement, CpuStorage};
use crate::backend::{
    AdamStep, AdamTensor, BackendDevice, BackendStorage, BinaryOp, CmpOp, ConvParams, Distribution, Elems,
    GradElems, IndexOp, LogicalOp, LstmBackwardStep, LstmForwardStep, PhiloxState, PoolParams, ReduceOp,
    RngState, ScaleUpdate, ScatterOp, SgdStep, SgdTensor, SoftmaxOp, StepCount, StepScalars, UnaryOp,
    UnscaleGrads,
};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Device, Error, Result};
use half::{bf16, f16};

/// Calls `$f::<T>(...)` with `T` the Rust type of the floating dtype `$dtype`.
macro_rules! with_float_type {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            _ => unreachable!("floating dtype checked"),
        }
    };
}

/// The host, as a backend device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDevice;

impl BackendDevice for CpuDevice {
    type Storage = CpuStorage;

    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<CpuStorage> {
        Ok(cpu)
    }

    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<CpuStorage> {
        CpuStorage::full(dtype, n, value)
    }

    fn alloc(&self, dtype: DType, n: usize) -> Result<CpuStorage> {
        self.full(dtype, n, 0.0)
    }

    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: PhiloxState) -> Result<CpuStorage> {
        let state = state.value("random")?;
        // Bernoulli draws through an f64 buffer of `n`.
        let widest = match dist {
            Distribution::Bernoulli { .. } => DType::F64,
            _ => dtype,
        };
        check_host_alloc("random", n, widest)?;
        random::random(dtype, n, dist, state)
    }

    fn randperm(&self, n: usize, state: RngState) -> Result<CpuStorage> {
        check_host_alloc("randperm", n.saturating_mul(3), DType::I64)?; // (key, index) pairs, then the result
        Ok(random::randperm(n, state))
    }
}

/// Elements of `layout` with `dim` replaced by `len` (an index op's output), checked.
fn with_dim_len(op: &'static str, layout: &Layout, dim: usize, len: usize) -> Result<usize> {
    let others = layout
        .dims()
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != dim)
        .try_fold(1usize, |acc, (_, &d)| acc.checked_mul(d));
    others.and_then(|o| o.checked_mul(len)).ok_or_else(|| {
        Error::invalid(
            op,
            format!("the output of {:?} with {len} indices overflows", layout.dims()),
        )
    })
}

/// Elements of the `[B.., m, n]` product of `[B.., m, k]` at `a` and `[B.., k, n]` at `b`.
fn matmul_out_len(a: &Layout, b: &Layout) -> Result<usize> {
    let rows = a.dims()[..a.dims().len().saturating_sub(1)]
        .iter()
        .product::<usize>();
    crate::shape::checked_mul(
        "matmul",
        "the output rows × columns",
        rows,
        *b.dims().last().unwrap_or(&1),
    )
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
        check_host_alloc("to_dtype", layout.numel(), dtype)?;
        Ok(CpuStorage::to_dtype(self, layout, dtype))
    }

    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        check_host_alloc("contiguous", layout.numel(), self.dtype())?;
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
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
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
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
        let r = CpuStorage::binary(self, op, layout, rhs, rhs_layout)?;
        CpuStorage::copy_strided_from(out, out_layout, &r, &Layout::contiguous(layout.shape().clone()));
        Ok(())
    }

    fn binary_inplace(
        &mut self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<()> {
        CpuStorage::binary_inplace(self, op, layout, rhs, rhs_layout)
    }

    fn compare(
        &self,
        op: CmpOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<CpuStorage> {
        check_host_alloc(op.name(), layout.numel(), DType::Bool)?;
        CpuStorage::compare(self, op, layout, rhs, rhs_layout)
    }

    fn logical(
        &self,
        op: LogicalOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
    ) -> Result<CpuStorage> {
        check_host_alloc(op.name(), layout.numel(), DType::Bool)?;
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
        check_host_alloc("where", layout.numel(), on_true.dtype())?;
        CpuStorage::where_cond(self, layout, on_true, true_layout, on_false, false_layout)
    }

    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CpuStorage> {
        check_host_alloc(
            op.name(),
            layout.numel(),
            op.result_dtype(self.dtype()).unwrap_or(self.dtype()),
        )?;
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
        check_host_alloc("matmul", matmul_out_len(layout, rhs_layout)?, self.dtype())?;
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
        check_host_alloc("linear", matmul_out_len(layout, rhs_layout)?, self.dtype())?;
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
        check_host_alloc(
            name,
            with_dim_len(name, layout, dim, index_layout.numel())?,
            self.dtype(),
        )?;
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
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
        CpuStorage::index_write(self, op, layout, dim, index, index_layout, src, src_layout)
    }

    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(CpuStorage, usize)> {
        CpuStorage::one_hot(self, layout, num_classes)
    }

    fn nll_loss_forward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CpuStorage, CpuStorage)> {
        CpuStorage::nll_loss_forward(self, target, weight, mc, ignore_index, mean)
    }

    fn nll_loss_backward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        total_weight: &CpuStorage,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CpuStorage> {
        check_host_alloc("nll_loss_backward", mc.0.saturating_mul(mc.1), self.dtype())?;
        CpuStorage::nll_loss_backward(self, target, weight, total_weight, mc, ignore_index, mean)
    }

    fn relu_backward(&self, grad_out: &CpuStorage, len: usize) -> Result<Option<CpuStorage>> {
        check_host_alloc("relu_backward", len, self.dtype())?;
        Ok(unary::relu_backward(self, grad_out, len))
    }

    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CpuStorage> {
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
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
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
        CpuStorage::softmax_backward(self, layout, grad, grad_layout, op, dim)
    }

    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<CpuStorage> {
        let state = state.value("bernoulli")?;
        check_host_alloc("bernoulli", layout.numel(), DType::F64)?;
        random::bernoulli(self, layout, state)
    }

    fn conv_forward(&self, weight: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        if let Some(out) = p.output() {
            check_host_alloc("convolution", out.iter().product(), p.dtype)?;
        }
        conv::forward(self, weight, p)
    }

    fn conv_backward_data(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        check_host_alloc("convolution_backward", p.input.iter().product(), p.dtype)?;
        conv::backward_data(self, grad_out, p)
    }

    fn conv_backward_filter(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        conv::backward_filter(self, grad_out, p)
    }

    fn pool_forward(&self, p: &PoolParams) -> Result<Option<CpuStorage>> {
        if let Some(out) = p.output() {
            check_host_alloc("pool2d", out.iter().product(), p.dtype)?;
        }
        pool::forward(self, p)
    }

    fn pool_backward(
        &self,
        _output: &CpuStorage,
        grad_out: &CpuStorage,
        p: &PoolParams,
    ) -> Result<Option<CpuStorage>> {
        check_host_alloc("pool2d_backward", p.input.iter().product(), p.dtype)?;
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

    fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, CpuStorage>>,
        amp: StepScalars<'_, CpuStorage>,
    ) -> Result<()> {
        // The host reads the flag, the scale and the counts from host memory directly.
        if amp.found_inf.as_ref().is_some_and(|f| scalar::<f32>(f) != 0.0) {
            return Ok(());
        }
        let grad_scale = amp.grad_scale.as_ref().map(|s| scalar::<f32>(s) as f64);
        let step = &AdamStep {
            lr: amp.lr.as_ref().map_or(step.lr, scalar::<f64>),
            ..*step
        };
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let dtype = first.param.storage.dtype();
        with_float_type!(dtype, adam_slices(step, tensors, grad_scale));
        Ok(())
    }

    fn sgd_step(
        step: &SgdStep,
        tensors: Vec<SgdTensor<'_, CpuStorage>>,
        amp: StepScalars<'_, CpuStorage>,
    ) -> Result<()> {
        if amp.found_inf.as_ref().is_some_and(|f| scalar::<f32>(f) != 0.0) {
            return Ok(());
        }
        let grad_scale = amp.grad_scale.as_ref().map(|s| scalar::<f32>(s) as f64);
        let step = &SgdStep {
            lr: amp.lr.as_ref().map_or(step.lr, scalar::<f64>),
            ..*step
        };
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let dtype = first.param.storage.dtype();
        with_float_type!(dtype, sgd_slices(step, tensors, grad_scale));
        Ok(())
    }

    fn non_finite_check_and_unscale(
        mut grads: UnscaleGrads<'_, CpuStorage>,
        found_inf: Elems<&mut CpuStorage>,
        inv_scale: Elems<&CpuStorage>,
    ) -> Result<()> {
        fn run<T: OptimElement>(storage: &mut CpuStorage, g: &Elems<usize>, inv: f32) -> bool {
            let values = &mut T::slice_mut(storage).expect("dtype checked")[g.offset..g.offset + g.len];
            amp::non_finite_check_and_unscale(values, inv)
        }
        let inv = scalar::<f32>(&inv_scale);
        let mut found = false;
        for g in &grads.grads {
            let s = &mut *grads.storages[g.storage];
            found |= match s.dtype() {
                DType::F32 => run::<f32>(s, g, inv),
                DType::F64 => run::<f64>(s, g, inv),
                DType::F16 => run::<f16>(s, g, inv),
                DType::BF16 => run::<bf16>(s, g, inv),
                _ => unreachable!("floating dtype checked"),
            };
        }
        if found {
            *scalar_mut::<f32>(found_inf) = 1.0;
        }
        Ok(())
    }

    fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut CpuStorage>,
        growth_tracker: Elems<&mut CpuStorage>,
        found_inf: Elems<&CpuStorage>,
    ) -> Result<()> {
        amp::update_scale(
            scalar_mut::<f32>(scale),
            scalar_mut::<i32>(growth_tracker),
            scalar::<f32>(&found_inf),
            u.growth_factor,
            u.backoff_factor,
            u.growth_interval,
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor steps: from the backend-neutral operands (`backend/step.rs`, checked by
// `storage.rs`) to the slices of `cpu/optim.rs`'s and `cpu/amp.rs`'s kernels.

/// The element of a one-element operand.
fn scalar<T: CpuElement>(e: &Elems<&CpuStorage>) -> T {
    T::slice(e.storage).expect("dtype checked")[e.offset]
}

/// The element of a one-element operand, writable.
fn scalar_mut<T: CpuElement>(e: Elems<&mut CpuStorage>) -> &mut T {
    &mut T::slice_mut(e.storage).expect("dtype checked")[e.offset]
}

/// The elements of a written operand.
fn slice_mut<T: CpuElement>(e: Elems<&mut CpuStorage>) -> &mut [T] {
    &mut T::slice_mut(e.storage).expect("dtype checked")[e.offset..e.offset + e.len]
}

/// A gradient as the kernels take it: unscaled and written back under a grad scale, else read.
fn grad_in<T: CpuElement>(g: GradElems<'_, CpuStorage>, grad_scale: Option<f64>) -> GradIn<'_, T> {
    match (g, grad_scale) {
        (GradElems::Unscaled(e), Some(s)) => GradIn::Scaled(slice_mut(e), s),
        (GradElems::Read(e), None) => {
            GradIn::Plain(&T::slice(e.storage).expect("dtype checked")[e.offset..e.offset + e.len])
        }
        _ => unreachable!("a gradient is written exactly under a grad scale (checked)"),
    }
}

/// Adam over the tensors of `T`: each device step count is incremented here, then the bias
/// corrections of every tensor come from its count.
fn adam_slices<T: OptimElement>(
    step: &AdamStep,
    tensors: Vec<AdamTensor<'_, CpuStorage>>,
    grad_scale: Option<f64>,
) {
    let s = AdamScalars {
        one_minus_beta1: 1.0 - step.beta1,
        beta2: step.beta2,
        one_minus_beta2: 1.0 - step.beta2,
        eps: step.eps,
        weight_decay: step.weight_decay,
        decay: 1.0 - step.lr * step.weight_decay,
        maximize: step.maximize,
        decoupled: step.decoupled_weight_decay,
    };
    let slices = tensors
        .into_iter()
        .map(|t| {
            let [step_size, bias_correction2_sqrt] = match t.step {
                StepCount::Host(n) => step.bias_corrections(n),
                StepCount::Device(c) => {
                    let n = scalar_mut::<f32>(c);
                    *n += 1.0;
                    step.bias_corrections(*n as f64)
                }
            };
            AdamSlices {
                param: slice_mut(t.param),
                grad: grad_in(t.grad, grad_scale),
                exp_avg: slice_mut(t.exp_avg),
                exp_avg_sq: slice_mut(t.exp_avg_sq),
                max_exp_avg_sq: t.max_exp_avg_sq.map(slice_mut),
                step_size,
                bias_correction2_sqrt,
            }
        })
        .collect();
    optim::adam::<T>(slices, &s);
}

/// SGD over the tensors of `T`.
fn sgd_slices<T: OptimElement>(
    step: &SgdStep,
    tensors: Vec<SgdTensor<'_, CpuStorage>>,
    grad_scale: Option<f64>,
) {
    let s = SgdScalars {
        lr: step.lr,
        momentum: step.momentum,
        one_minus_dampening: 1.0 - step.dampening,
        weight_decay: step.weight_decay,
        nesterov: step.nesterov,
        maximize: step.maximize,
        first_step: step.first_step,
    };
    let slices = tensors
        .into_iter()
        .map(|t| SgdSlices {
            param: slice_mut(t.param),
            grad: grad_in(t.grad, grad_scale),
            momentum_buffer: t.momentum_buffer.map(slice_mut),
        })
        .collect();
    optim::sgd::<T>(slices, &s);
}
