//! CPU kernels of the fused optimizer steps (`ops/fused_optim.rs`, reached through
//! its `OptimOps` below): each tensor's row-major elements are cut into [`PAR_CHUNK`]-element
//! pieces, and the pieces of all tensors run as one rayon loop once the step is bigger than
//! [`PAR_THRESHOLD`] elements.
//!
//! The arithmetic is `kernels/optim.cu`'s, op for op: f32 and f64 compute in their own type,
//! f16 and bf16 in f32, rounding once on store; hyperparameters are cast from f64 to the
//! arithmetic type. Rust never fuses a multiply and an add, so f32/f64 results are
//! bit-identical to the CUDA kernels' (which use `_rn` intrinsics for the same reason).
//!
//! Under a GradScaler ([`GradIn::Scaled`]) each gradient is divided by the grad scale before
//! the update and the quotient stored back, as in the CUDA kernels; the found-inf skip is
//! decided by its `OptimOps` below, which reads the flag from host memory.

use super::CpuStorage;
use super::{CpuElement, PAR_CHUNK, PAR_THRESHOLD};
use crate::backend::Elems;
use crate::backend::GradElems;
use crate::backend::StepCount;
use crate::backend::{
    AdamStep, AdamTensor, Arrives, BackendStorage, OptimOps, SgdStep, SgdTensor, StepScalars,
};
use crate::DType;
use crate::Result;
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::{Add, Div, Mul, Neg, Sub};

/// The arithmetic type of an optimizer step (f32 or f64).
pub(crate) trait OptimAcc:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    fn from_f64(v: f64) -> Self;
    fn sqrt(self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! optim_acc {
    ($t:ty) => {
        impl OptimAcc for $t {
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}
optim_acc!(f32);
optim_acc!(f64);

/// A floating-point element an optimizer step updates, with its arithmetic type.
pub(crate) trait OptimElement: CpuElement {
    type A: OptimAcc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

impl OptimElement for f32 {
    type A = f32;
    #[inline]
    fn load(self) -> f32 {
        self
    }
    #[inline]
    fn store(a: f32) -> f32 {
        a
    }
}

impl OptimElement for f64 {
    type A = f64;
    #[inline]
    fn load(self) -> f64 {
        self
    }
    #[inline]
    fn store(a: f64) -> f64 {
        a
    }
}

impl OptimElement for f16 {
    type A = f32;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(a: f32) -> f16 {
        f16::from_f32(a)
    }
}

impl OptimElement for bf16 {
    type A = f32;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}

/// A gradient of a fused step: read as is, or (under a GradScaler) divided by the grad scale
/// with the quotient written back.
pub(crate) enum GradIn<'a, T> {
    Plain(&'a [T]),
    Scaled(&'a mut [T], f64),
}

impl<'a, T: OptimElement> GradIn<'a, T> {
    /// The gradient cut into pieces of `n` elements.
    fn pieces(self, n: usize) -> Vec<GradIn<'a, T>> {
        match self {
            GradIn::Plain(g) => g.chunks(n).map(GradIn::Plain).collect(),
            GradIn::Scaled(g, s) => g.chunks_mut(n).map(|c| GradIn::Scaled(c, s)).collect(),
        }
    }

    /// Element `i` in the arithmetic type (unscaled and stored back under a GradScaler).
    #[inline]
    fn get(&mut self, i: usize) -> T::A {
        match self {
            GradIn::Plain(g) => g[i].load(),
            GradIn::Scaled(g, s) => {
                let q = g[i].load() / <T::A as OptimAcc>::from_f64(*s);
                g[i] = T::store(q);
                q
            }
        }
    }
}

/// PyTorch's `maximum`: NaN in either operand propagates.
#[inline]
fn maximum<A: OptimAcc>(x: A, y: A) -> A {
    if x.is_nan() || x > y {
        x
    } else {
        y
    }
}

/// The hyperparameters of an Adam/AdamW step shared by every tensor (see `kernels/optim.cu`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamScalars {
    pub one_minus_beta1: f64,
    pub beta2: f64,
    pub one_minus_beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// `1 - lr * weight_decay`, AdamW's factor on the parameter.
    pub decay: f64,
    pub maximize: bool,
    pub decoupled: bool,
}

/// One tensor of an Adam step: its parameter, gradient and state elements (row-major, equal
/// lengths; `max_exp_avg_sq` with amsgrad only) and its step size and `sqrt(bias_correction2)`.
pub(crate) struct AdamSlices<'a, T> {
    pub param: &'a mut [T],
    pub grad: GradIn<'a, T>,
    pub exp_avg: &'a mut [T],
    pub exp_avg_sq: &'a mut [T],
    pub max_exp_avg_sq: Option<&'a mut [T]>,
    pub step_size: f64,
    pub bias_correction2_sqrt: f64,
}

/// Runs one Adam/AdamW step over every tensor of `tensors`.
pub(crate) fn adam<T: OptimElement>(tensors: Vec<AdamSlices<'_, T>>, s: &AdamScalars) {
    let total: usize = tensors.iter().map(|t| t.param.len()).sum();
    let mut pieces = Vec::new();
    for t in tensors {
        let mut maxes = t.max_exp_avg_sq.map(|x| x.chunks_mut(PAR_CHUNK));
        let parts = t
            .param
            .chunks_mut(PAR_CHUNK)
            .zip(t.grad.pieces(PAR_CHUNK))
            .zip(t.exp_avg.chunks_mut(PAR_CHUNK))
            .zip(t.exp_avg_sq.chunks_mut(PAR_CHUNK));
        for (((param, grad), exp_avg), exp_avg_sq) in parts {
            pieces.push(AdamSlices {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                max_exp_avg_sq: maxes.as_mut().and_then(|it| it.next()),
                step_size: t.step_size,
                bias_correction2_sqrt: t.bias_correction2_sqrt,
            });
        }
    }
    if total > PAR_THRESHOLD {
        super::threads::parallel(|| pieces.into_par_iter().for_each(|p| adam_piece(p, s)));
    } else {
        pieces.into_iter().for_each(|p| adam_piece(p, s));
    }
}

fn adam_piece<T: OptimElement>(t: AdamSlices<'_, T>, s: &AdamScalars) {
    let c = <T::A as OptimAcc>::from_f64;
    let (omb1, beta2, omb2, eps) = (c(s.one_minus_beta1), c(s.beta2), c(s.one_minus_beta2), c(s.eps));
    let (wd, decay) = (c(s.weight_decay), c(s.decay));
    let neg_step_size = c(-t.step_size);
    let bc2_sqrt = c(t.bias_correction2_sqrt);
    let mut maxes = t.max_exp_avg_sq;
    let mut grad = t.grad;
    for i in 0..t.param.len() {
        let mut p = t.param[i].load();
        let mut g = grad.get(i);
        let mut m = t.exp_avg[i].load();
        let mut v = t.exp_avg_sq[i].load();
        if s.maximize {
            g = -g;
        }
        if s.weight_decay != 0.0 {
            if s.decoupled {
                p = p * decay;
            } else {
                g = g + p * wd;
            }
        }
        m = m + (g - m) * omb1;
        v = v * beta2 + g * g * omb2;
        let mut second = v;
        if let Some(x) = maxes.as_deref_mut() {
            second = maximum(x[i].load(), v);
            x[i] = T::store(second);
        }
        let denom = second.sqrt() / bc2_sqrt + eps;
        p = p + m / denom * neg_step_size;
        t.param[i] = T::store(p);
        t.exp_avg[i] = T::store(m);
        t.exp_avg_sq[i] = T::store(v);
    }
}

/// The hyperparameters of an SGD step (see `kernels/optim.cu`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdScalars {
    pub lr: f64,
    pub momentum: f64,
    pub one_minus_dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
    /// The momentum buffer is set to the gradient instead of updated.
    pub first_step: bool,
}

/// One tensor of an SGD step: parameter, gradient and (with momentum) buffer elements.
pub(crate) struct SgdSlices<'a, T> {
    pub param: &'a mut [T],
    pub grad: GradIn<'a, T>,
    pub momentum_buffer: Option<&'a mut [T]>,
}

/// Runs one SGD step over every tensor of `tensors`; buffers must be present when
/// `s.momentum != 0`.
pub(crate) fn sgd<T: OptimElement>(tensors: Vec<SgdSlices<'_, T>>, s: &SgdScalars) {
    let total: usize = tensors.iter().map(|t| t.param.len()).sum();
    let mut pieces = Vec::new();
    for t in tensors {
        let mut bufs = t.momentum_buffer.map(|b| b.chunks_mut(PAR_CHUNK));
        for (param, grad) in t.param.chunks_mut(PAR_CHUNK).zip(t.grad.pieces(PAR_CHUNK)) {
            pieces.push(SgdSlices {
                param,
                grad,
                momentum_buffer: bufs.as_mut().and_then(|it| it.next()),
            });
        }
    }
    if total > PAR_THRESHOLD {
        super::threads::parallel(|| pieces.into_par_iter().for_each(|p| sgd_piece(p, s)));
    } else {
        pieces.into_iter().for_each(|p| sgd_piece(p, s));
    }
}

fn sgd_piece<T: OptimElement>(t: SgdSlices<'_, T>, s: &SgdScalars) {
    let c = <T::A as OptimAcc>::from_f64;
    let (neg_lr, momentum, omd, wd) = (
        c(-s.lr),
        c(s.momentum),
        c(s.one_minus_dampening),
        c(s.weight_decay),
    );
    let mut bufs = if s.momentum != 0.0 {
        t.momentum_buffer
    } else {
        None
    };
    let mut grad = t.grad;
    for i in 0..t.param.len() {
        let p = t.param[i].load();
        let mut g = grad.get(i);
        if s.maximize {
            g = -g;
        }
        if s.weight_decay != 0.0 {
            g = g + p * wd;
        }
        if let Some(b) = bufs.as_deref_mut() {
            let buf = if s.first_step {
                g
            } else {
                b[i].load() * momentum + g * omd
            };
            b[i] = T::store(buf);
            g = if s.nesterov { g + buf * momentum } else { buf };
        }
        t.param[i] = T::store(p + g * neg_lr);
    }
}

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

/// CPU tensors never arrive in row blocks (Note [Arrivals in row blocks] in
/// `storage/row_blocks.rs`): an Adam step's operands on the CPU have no [`Arrival`]s.
///
/// [`Arrival`]: crate::backend::Arrival
impl Arrives for CpuStorage {
    type Event = std::convert::Infallible;
}

impl OptimOps for CpuStorage {
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
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor steps: from the backend-neutral operands (`backend/step.rs`, checked by
// `storage/families.rs`) to the slices of `cpu/optim.rs`'s and `cpu/amp.rs`'s kernels.

/// The element of a one-element operand.
pub(super) fn scalar<T: CpuElement>(e: &Elems<&CpuStorage>) -> T {
    T::slice(e.storage).expect("dtype checked")[e.offset]
}

/// The element of a one-element operand, writable.
pub(super) fn scalar_mut<T: CpuElement>(e: Elems<&mut CpuStorage>) -> &mut T {
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
    self::adam::<T>(slices, &s);
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
    self::sgd::<T>(slices, &s);
}
