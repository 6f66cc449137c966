//! Fused multi-tensor optimizer steps (`torch._fused_adam_`, `torch._fused_sgd_`): [`adam_`]
//! (Adam and AdamW) and [`sgd_`] update many parameters and their state tensors in place in a
//! few kernel launches (CUDA: `kernels/optim.cu`, 48 tensors a launch) or one rayon loop (CPU:
//! `cpu/optim.rs`), instead of several tensor ops per parameter.
//!
//! Semantics are those of PyTorch's `_single_tensor_adam` / `_single_tensor_sgd` (and of
//! ember-nn's per-tensor `optim::adam` / `optim::sgd`), op for op, per element:
//! ```text
//! Adam:  g = maximize ? -grad : grad
//!        weight_decay != 0:  AdamW: p = p * (1 - lr * weight_decay);  Adam: g = g + p * weight_decay
//!        m = m + (g - m) * (1 - beta1)
//!        v = v * beta2 + g * g * (1 - beta2)
//!        s = amsgrad ? (vmax = maximum(vmax, v)) : v
//!        p = p + m / (sqrt(s) / sqrt(bias_correction2) + eps) * -(lr / bias_correction1)
//! SGD:   g = maximize ? -grad : grad
//!        weight_decay != 0:  g = g + p * weight_decay
//!        momentum != 0:  buf = first_step ? g : buf * momentum + g * (1 - dampening)
//!                        g = nesterov ? g + buf * momentum : buf
//!        p = p + g * -lr
//! ```
//! with `bias_correction{1,2} = 1 - beta{1,2}^step` computed in f64 from each parameter's own
//! step count: on the host from counts the caller knows ([`AdamSteps::Host`]), or by the step
//! itself from 0-d f32 count tensors on the device ([`AdamSteps::Device`]); either way the host
//! never waits for the device.
//!
//! Under a GradScaler ([`adam_scaled_`], [`sgd_scaled_`] with a [`GradScaling`]) a nonzero
//! `found_inf` makes the step write nothing (device step counts included), and a `grad_scale`
//! divides each gradient before the update, the quotient written back into the gradient, as
//! PyTorch's `_fused_adam_(..., grad_scale=, found_inf=)`; both are read on the device. Hyperparameters are cast to the
//! arithmetic type (f32 for f32/f16/bf16, f64 for f64); f16/bf16 are computed in f32 and rounded
//! once on store, as PyTorch's fused kernels do. For f32 and f64 the results are the same bits
//! as the composed per-tensor ops, on both devices.
//!
//! Note [Fused step preconditions]: every tensor of one call is contiguous, of one floating
//! dtype and one device (group by device and dtype first, as PyTorch's
//! `_group_tensors_by_device_and_dtype`), each state tensor and gradient has its parameter's
//! shape, and no two tensors share a storage (the call locks every storage once, in a global
//! order, for the whole update). [`can_fuse`] answers whether a set of tensors qualifies; the
//! steps return a typed error otherwise. The updates write in place: each written storage's
//! version is bumped once, as by any in-place op, and nothing is recorded by autograd; as with
//! other in-place ops, writing a tensor that requires grad is an error unless grad mode is off
//! (optimizers run under `no_grad`).

use crate::autograd;
use crate::cpu::optim::{
    self as cpu_optim, AdamScalars, AdamTensor, GradIn, OptimElement, SgdScalars, SgdTensor,
};
use crate::cpu::CpuElement;
use crate::cuda::optim::{multi_tensor_step, OptimKernel, OptimTensor, ADAM_DEVICE_STEPS};
use crate::dispatch::{self, policy};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};
use half::{bf16, f16};
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// The hyperparameters of one [`adam_`] call (`torch.optim.Adam` / `AdamW` arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment average.
    pub beta1: f64,
    /// Decay rate of the second moment average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// L2 penalty (Adam) or decoupled decay rate (AdamW).
    pub weight_decay: f64,
    /// Use the running maximum of the second moments (`max_exp_avg_sqs` must be given).
    pub amsgrad: bool,
    /// Maximize the objective.
    pub maximize: bool,
    /// AdamW: `p *= 1 - lr * weight_decay` instead of adding `weight_decay * p` to the gradient.
    pub decoupled_weight_decay: bool,
}

/// The hyperparameters of one [`sgd_`] call (`torch.optim.SGD` arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 disables the momentum buffers (then none need be given).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the buffer.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Maximize the objective.
    pub maximize: bool,
    /// The buffers are new: they are set to the (decayed) gradient instead of updated, as
    /// PyTorch does when a parameter has no `momentum_buffer` yet. Their old contents are
    /// never read, so `Tensor::empty_like`-style buffers are fine.
    pub first_step: bool,
}

/// True when `tensors` satisfy Note [Fused step preconditions] as one group: all contiguous,
/// of one floating dtype, on one device, no two sharing a storage. (Shapes are checked by the
/// steps themselves.)
pub fn can_fuse(tensors: &[&Tensor]) -> bool {
    let Some(first) = tensors.first() else {
        return true;
    };
    let (dtype, device) = (first.dtype(), first.device());
    if !dtype.is_floating_point() {
        return false;
    }
    let uniform = tensors
        .iter()
        .all(|t| t.dtype() == dtype && t.device() == device && t.is_contiguous());
    let mut ids: Vec<usize> = tensors.iter().map(|t| t.storage().id()).collect();
    ids.sort_unstable();
    uniform && ids.windows(2).all(|w| w[0] != w[1])
}

/// One list of tensors of a call, and whether the step writes it.
struct List<'a> {
    name: &'static str,
    tensors: &'a [Tensor],
    written: bool,
}

/// Checks Note [Fused step preconditions] for `lists` (the first is the parameters) and the
/// autograd rule of in-place writes; returns the dtype and device of the group, `None` when
/// there are no parameters.
fn check(op: &'static str, lists: &[List<'_>]) -> Result<Option<(DType, Device)>> {
    let params = lists[0].tensors;
    for l in &lists[1..] {
        if l.tensors.len() != params.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "expected one {} per parameter ({}), got {}",
                    l.name,
                    params.len(),
                    l.tensors.len()
                ),
            ));
        }
    }
    let Some(first) = params.first() else {
        return Ok(None);
    };
    let (dtype, device) = (first.dtype(), first.device());
    if !dtype.is_floating_point() {
        return Err(Error::UnsupportedDType {
            op,
            dtype,
            hint: "; optimizer steps update floating-point tensors",
        });
    }
    let grad_mode = autograd::is_grad_enabled();
    for l in lists {
        for (t, p) in l.tensors.iter().zip(params) {
            if t.dtype() != dtype {
                return Err(Error::DTypeMismatch {
                    op,
                    expected: dtype,
                    found: t.dtype(),
                });
            }
            if t.device() != device {
                return Err(crate::dispatch::device_mismatch(op, device, t.device()));
            }
            if t.shape() != p.shape() {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: p.shape().clone(),
                    rhs: t.shape().clone(),
                    hint: "each gradient and state tensor must have its parameter's shape",
                });
            }
            if !t.is_contiguous() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "a {} is not contiguous; fused steps take contiguous tensors (call contiguous(), or use the per-tensor step)",
                        l.name
                    ),
                ));
            }
            if l.written && grad_mode && t.requires_grad() {
                return Err(Error::Autograd(format!(
                    "{op} writes a {} that requires grad in place; wrap the step in no_grad()",
                    l.name
                )));
            }
        }
    }
    let all: Vec<&Tensor> = lists.iter().flat_map(|l| l.tensors.iter()).collect();
    if !can_fuse(&all) {
        return Err(Error::invalid(
            op,
            "two of the tensors share a storage; fused steps need each parameter, gradient and state tensor in its own storage (use the per-tensor step)",
        ));
    }
    Ok(Some((dtype, device)))
}

/// A held lock on one storage.
enum Guard<'a> {
    Read(RwLockReadGuard<'a, Storage>),
    Write(RwLockWriteGuard<'a, Storage>),
}

impl Guard<'_> {
    fn storage(&self) -> &Storage {
        match self {
            Guard::Read(g) => g,
            Guard::Write(g) => g,
        }
    }

    fn storage_mut(&mut self) -> &mut Storage {
        match self {
            Guard::Write(g) => &mut *g,
            Guard::Read(_) => unreachable!("written lists are write-locked"),
        }
    }
}

/// Locks every storage of `lists` (write locks, bumping the version, for written lists), in
/// the order of their storage ids so that two calls never wait on each other; one guard list
/// per list. The storages are distinct (checked by [`check`]), so no lock is taken twice.
fn lock_all<'a>(lists: &[List<'a>]) -> Vec<Vec<Guard<'a>>> {
    let mut order: Vec<(usize, usize, usize)> = Vec::new();
    for (li, l) in lists.iter().enumerate() {
        for (ti, t) in l.tensors.iter().enumerate() {
            order.push((t.storage().id(), li, ti));
        }
    }
    order.sort_unstable();
    let mut slots: Vec<Vec<Option<Guard<'a>>>> = lists
        .iter()
        .map(|l| (0..l.tensors.len()).map(|_| None).collect())
        .collect();
    for (_, li, ti) in order {
        let storage = lists[li].tensors[ti].storage();
        slots[li][ti] = Some(if lists[li].written {
            Guard::Write(storage.write())
        } else {
            Guard::Read(storage.read())
        });
    }
    slots
        .into_iter()
        .map(|l| {
            l.into_iter()
                .map(|g| g.expect("every tensor was locked"))
                .collect()
        })
        .collect()
}

/// The elements of each tensor of `tensors` (contiguous, of `T`) in its write-locked storage.
fn slices_mut<'g, T: OptimElement>(guards: &'g mut [Guard<'_>], tensors: &[Tensor]) -> Vec<&'g mut [T]> {
    guards
        .iter_mut()
        .zip(tensors)
        .map(|(g, t)| {
            let (off, n) = (t.storage_offset(), t.numel());
            match g.storage_mut() {
                Storage::Cpu(c) => &mut T::slice_mut(c).expect("dtype checked")[off..off + n],
                Storage::Cuda(_) => unreachable!("device checked"),
            }
        })
        .collect()
}

/// The elements of each tensor of `tensors` (contiguous, of `T`) in its read-locked storage.
fn slices<'g, T: OptimElement>(guards: &'g [Guard<'_>], tensors: &[Tensor]) -> Vec<&'g [T]> {
    guards
        .iter()
        .zip(tensors)
        .map(|(g, t)| {
            let (off, n) = (t.storage_offset(), t.numel());
            match g.storage() {
                Storage::Cpu(c) => &T::slice(c).expect("dtype checked")[off..off + n],
                Storage::Cuda(_) => unreachable!("device checked"),
            }
        })
        .collect()
}

/// The device address of each tensor's first element (0 for a list that is absent).
fn device_ptrs(guards: &[Guard<'_>], tensors: &[Tensor]) -> Vec<u64> {
    guards
        .iter()
        .zip(tensors)
        .map(|(g, t)| match g.storage() {
            Storage::Cuda(c) => c.ptr(t.layout()),
            Storage::Cpu(_) => unreachable!("device checked"),
        })
        .collect()
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

/// Gradient scaling of a fused step under a GradScaler: PyTorch's `grad_scale=` and
/// `found_inf=` arguments of `_fused_adam_` / `_fused_sgd_`. Each is a one-element f32 tensor
/// on the parameters' device that the step reads there (Note [AMP scalars live on the device]
/// in `ops/amp_scaling.rs`); `GradScaling::default()` is a plain step.
#[derive(Debug, Clone, Copy, Default)]
pub struct GradScaling<'a> {
    /// The gradients are divided by it before the update, and the unscaled gradients are
    /// written back into the gradient tensors (as PyTorch's fused steps do).
    pub grad_scale: Option<&'a Tensor>,
    /// When nonzero the step writes nothing: parameters, gradients, state tensors and step
    /// counts keep their values.
    pub found_inf: Option<&'a Tensor>,
}

/// The step counts of an [`adam_scaled_`] call, one per parameter.
#[derive(Debug, Clone, Copy)]
pub enum AdamSteps<'a> {
    /// Each parameter's count *after* this step, known on the host, which computes the bias
    /// corrections (what [`adam_`] takes). Cannot be combined with `found_inf`: the host would
    /// not know whether the step happened.
    Host(&'a [f64]),
    /// 0-d f32 tensors on the parameters' device holding each count *before* this step
    /// (PyTorch's `state_steps` of fused and capturable Adam): the step adds 1 to each (unless
    /// `found_inf` is set) and computes the bias corrections from it on the device, so the
    /// host never reads them. On CUDA the corrections use the device's `pow`, which may differ
    /// from the host's in the last bit of the f64.
    Device(&'a [Tensor]),
}

/// Checks the grad scale and found-inf tensors of a step on `device` and adds them to `lists`
/// (read-only); returns their positions in `lists`.
fn scaling_lists<'a>(
    op: &'static str,
    scaling: &GradScaling<'a>,
    device: Device,
    lists: &mut Vec<List<'a>>,
) -> Result<[Option<usize>; 2]> {
    let mut at = [None, None];
    let named = [
        ("grad_scale", scaling.grad_scale),
        ("found_inf", scaling.found_inf),
    ];
    for (k, (name, t)) in named.into_iter().enumerate() {
        let Some(t) = t else { continue };
        if t.dtype() != DType::F32 || t.numel() != 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "{name} must be a one-element f32 tensor, got {} elements of {}",
                    t.numel(),
                    t.dtype()
                ),
            ));
        }
        if t.device() != device {
            return Err(crate::dispatch::device_mismatch(op, device, t.device()));
        }
        at[k] = Some(lists.len());
        lists.push(List {
            name,
            tensors: std::slice::from_ref(t),
            written: false,
        });
    }
    Ok(at)
}

/// Errors unless every storage of `lists` is distinct (see Note [Fused step preconditions]).
fn check_distinct(op: &'static str, lists: &[List<'_>]) -> Result<()> {
    let mut ids: Vec<usize> = lists
        .iter()
        .flat_map(|l| l.tensors.iter().map(|t| t.storage().id()))
        .collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid(
            op,
            "two of the tensors share a storage; fused steps need each parameter, gradient, state tensor, step count and scaling tensor in its own storage",
        ));
    }
    Ok(())
}

/// The f32 value of a locked one-element CPU tensor.
fn cpu_f32(guard: &Guard<'_>, t: &Tensor) -> f32 {
    match guard.storage() {
        Storage::Cpu(c) => f32::slice(c).expect("dtype checked")[t.storage_offset()],
        Storage::Cuda(_) => unreachable!("device checked"),
    }
}

/// The gradients of a CPU step: unscaled and written back under a grad scale, else read.
fn grads_in<'g, T: OptimElement>(
    guards: &'g mut [Guard<'_>],
    tensors: &[Tensor],
    grad_scale: Option<f64>,
) -> Vec<GradIn<'g, T>> {
    match grad_scale {
        Some(s) => slices_mut::<T>(guards, tensors)
            .into_iter()
            .map(|g| GradIn::Scaled(g, s))
            .collect(),
        None => slices::<T>(guards, tensors)
            .into_iter()
            .map(GradIn::Plain)
            .collect(),
    }
}

/// One Adam (or, with `decoupled_weight_decay`, AdamW) step of every `params[i]` in place,
/// updating `exp_avgs[i]`, `exp_avg_sqs[i]` and, with `amsgrad`, `max_exp_avg_sqs[i]`;
/// `steps[i]` is parameter i's step count after this step (1 on the first). See the module docs
/// for the formula and Note [Fused step preconditions] for what the tensors must satisfy.
/// The same as [`adam_scaled_`] with [`AdamSteps::Host`] and no gradient scaling.
pub fn adam_(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    max_exp_avg_sqs: Option<&[Tensor]>,
    steps: &[f64],
    cfg: &AdamStep,
) -> Result<()> {
    adam_scaled_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        AdamSteps::Host(steps),
        cfg,
        GradScaling::default(),
    )
}

/// [`adam_`] with the step counts on the host or the device ([`AdamSteps`]) and, under a
/// GradScaler, the gradient scaling of [`GradScaling`] (PyTorch's `_fused_adam_` with
/// `grad_scale=` and `found_inf=`): with device steps nothing of the step reads a value back to
/// the host, so a skipped step is decided on the device. The step tensors, grad scale and
/// found-inf flag are locked with the others and must be in storages of their own.
#[allow(clippy::too_many_arguments)]
pub fn adam_scaled_(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    max_exp_avg_sqs: Option<&[Tensor]>,
    steps: AdamSteps<'_>,
    cfg: &AdamStep,
    scaling: GradScaling<'_>,
) -> Result<()> {
    let observed: Vec<&Tensor> = params.iter().collect();
    dispatch::call_list(&policy::FUSED_ADAM, &observed, |_| {
        adam_scaled_prepared(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            cfg,
            scaling,
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn adam_scaled_prepared(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    max_exp_avg_sqs: Option<&[Tensor]>,
    steps: AdamSteps<'_>,
    cfg: &AdamStep,
    scaling: GradScaling<'_>,
) -> Result<()> {
    const OP: &str = "adam_";
    let steps_len = match steps {
        AdamSteps::Host(s) => s.len(),
        AdamSteps::Device(s) => s.len(),
    };
    if steps_len != params.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "expected one step count per parameter ({}), got {steps_len}",
                params.len()
            ),
        ));
    }
    if let (AdamSteps::Host(_), Some(_)) = (steps, scaling.found_inf) {
        return Err(Error::invalid(
            OP,
            "found_inf needs the step counts on the device (AdamSteps::Device): a skipped step must not advance them",
        ));
    }
    let max_list = match (cfg.amsgrad, max_exp_avg_sqs) {
        (true, Some(m)) => m,
        (true, None) => {
            return Err(Error::invalid(
                OP,
                "amsgrad needs max_exp_avg_sqs (one zero-initialized tensor per parameter)",
            ))
        }
        (false, _) => &[],
    };
    let mut lists = vec![
        List {
            name: "parameter",
            tensors: params,
            written: true,
        },
        List {
            name: "gradient",
            tensors: grads,
            written: scaling.grad_scale.is_some(),
        },
        List {
            name: "exp_avg",
            tensors: exp_avgs,
            written: true,
        },
        List {
            name: "exp_avg_sq",
            tensors: exp_avg_sqs,
            written: true,
        },
    ];
    if cfg.amsgrad {
        lists.push(List {
            name: "max_exp_avg_sq",
            tensors: max_list,
            written: true,
        });
    }
    let Some((dtype, device)) = check(OP, &lists)? else {
        return Ok(());
    };
    let param_lists = lists.len();
    let steps_at = match steps {
        AdamSteps::Host(_) => None,
        AdamSteps::Device(s) => {
            for t in s {
                if t.dtype() != DType::F32 || t.numel() != 1 {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "device step counts are one-element f32 tensors, got {} elements of {}",
                            t.numel(),
                            t.dtype()
                        ),
                    ));
                }
                if t.device() != device {
                    return Err(crate::dispatch::device_mismatch(OP, device, t.device()));
                }
                if autograd::is_grad_enabled() && t.requires_grad() {
                    return Err(Error::Autograd(format!(
                        "{OP} writes a step count that requires grad in place; wrap the step in no_grad()"
                    )));
                }
            }
            lists.push(List {
                name: "step count",
                tensors: s,
                written: true,
            });
            Some(lists.len() - 1)
        }
    };
    let [scale_at, found_at] = scaling_lists(OP, &scaling, device, &mut lists)?;
    check_distinct(OP, &lists)?;
    let scalars = AdamScalars {
        one_minus_beta1: 1.0 - cfg.beta1,
        beta2: cfg.beta2,
        one_minus_beta2: 1.0 - cfg.beta2,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
        decay: 1.0 - cfg.lr * cfg.weight_decay,
        maximize: cfg.maximize,
        decoupled: cfg.decoupled_weight_decay,
    };
    // Step size and sqrt(bias_correction2) of a step count, as `_single_tensor_adam`.
    let corrections = |step: f64| -> [f64; 2] {
        let bias_correction1 = 1.0 - cfg.beta1.powf(step);
        let bias_correction2 = 1.0 - cfg.beta2.powf(step);
        [cfg.lr / bias_correction1, bias_correction2.sqrt()]
    };
    let mut guards = lock_all(&lists);
    match device {
        Device::Cpu => {
            // The host reads the flag, the scale and the counts from host memory directly.
            if let Some(at) = found_at {
                if cpu_f32(&guards[at][0], &lists[at].tensors[0]) != 0.0 {
                    return Ok(());
                }
            }
            let grad_scale = scale_at.map(|at| cpu_f32(&guards[at][0], &lists[at].tensors[0]) as f64);
            let per_tensor: Vec<[f64; 2]> = match (steps, steps_at) {
                (AdamSteps::Host(s), _) => s.iter().map(|&step| corrections(step)).collect(),
                (AdamSteps::Device(s), Some(at)) => guards[at]
                    .iter_mut()
                    .zip(s)
                    .map(|(g, t)| match g.storage_mut() {
                        Storage::Cpu(c) => {
                            let step = &mut f32::slice_mut(c).expect("dtype checked")[t.storage_offset()];
                            *step += 1.0;
                            corrections(*step as f64)
                        }
                        Storage::Cuda(_) => unreachable!("device checked"),
                    })
                    .collect(),
                (AdamSteps::Device(_), None) => unreachable!("device steps are locked"),
            };
            fn run<T: OptimElement>(
                guards: &mut [Vec<Guard<'_>>],
                lists: &[List<'_>],
                per_tensor: &[[f64; 2]],
                s: &AdamScalars,
                grad_scale: Option<f64>,
            ) {
                let (gp, rest) = guards.split_first_mut().expect("params list");
                let (gg, rest) = rest.split_first_mut().expect("grads list");
                let (gm, rest) = rest.split_first_mut().expect("exp_avgs list");
                let (gv, rest) = rest.split_first_mut().expect("exp_avg_sqs list");
                let p = slices_mut::<T>(gp, lists[0].tensors);
                let g = grads_in::<T>(gg, lists[1].tensors, grad_scale);
                let m = slices_mut::<T>(gm, lists[2].tensors);
                let v = slices_mut::<T>(gv, lists[3].tensors);
                let mut x = rest
                    .first_mut()
                    .map(|gx| slices_mut::<T>(gx, lists[4].tensors).into_iter());
                let tensors = p
                    .into_iter()
                    .zip(g)
                    .zip(m)
                    .zip(v)
                    .zip(per_tensor)
                    .map(|((((param, grad), exp_avg), exp_avg_sq), sc)| AdamTensor {
                        param,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        max_exp_avg_sq: x.as_mut().and_then(|it| it.next()),
                        step_size: sc[0],
                        bias_correction2_sqrt: sc[1],
                    })
                    .collect();
                cpu_optim::adam::<T>(tensors, s);
            }
            let param_guards = &mut guards[..param_lists];
            with_float_type!(
                dtype,
                run(param_guards, &lists, &per_tensor, &scalars, grad_scale)
            );
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ptrs: Vec<Vec<u64>> = guards
                .iter()
                .zip(&lists)
                .map(|(g, l)| device_ptrs(g, l.tensors))
                .collect();
            let tensors: Vec<OptimTensor> = (0..params.len())
                .map(|i| {
                    let mut p = [0u64; 6];
                    for (k, list) in ptrs[..param_lists].iter().enumerate() {
                        p[k] = list[i];
                    }
                    if let Some(at) = steps_at {
                        p[5] = ptrs[at][i];
                    }
                    OptimTensor {
                        ptrs: p,
                        numel: params[i].numel(),
                        scalars: match steps {
                            AdamSteps::Host(s) => corrections(s[i]),
                            AdamSteps::Device(_) => [0.0; 2],
                        },
                    }
                })
                .collect();
            let flags = cfg.amsgrad as i32
                | (cfg.maximize as i32) << 1
                | (cfg.decoupled_weight_decay as i32) << 2
                | if steps_at.is_some() { ADAM_DEVICE_STEPS } else { 0 };
            let kernel = OptimKernel::Adam {
                lr: cfg.lr,
                beta1: cfg.beta1,
                one_minus_beta1: scalars.one_minus_beta1,
                beta2: scalars.beta2,
                one_minus_beta2: scalars.one_minus_beta2,
                eps: scalars.eps,
                weight_decay: scalars.weight_decay,
                decay: scalars.decay,
                grad_scale: scale_at.map_or(0, |at| ptrs[at][0]),
                found_inf: found_at.map_or(0, |at| ptrs[at][0]),
                flags,
            };
            // The guards are held until every launch is enqueued.
            let r = multi_tensor_step(ordinal, dtype, &tensors, kernel);
            drop(guards);
            r
        }
    }
}

/// One SGD step of every `params[i]` in place from `grads[i]`, updating
/// `momentum_buffers[i]` when `momentum != 0` (the buffers are then required; with
/// `first_step` they are overwritten with the gradient). See the module docs for the formula and
/// Note [Fused step preconditions] for what the tensors must satisfy. The same as
/// [`sgd_scaled_`] without gradient scaling.
pub fn sgd_(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
) -> Result<()> {
    sgd_scaled_(params, grads, momentum_buffers, cfg, GradScaling::default())
}

/// [`sgd_`] under a GradScaler: the gradient scaling of [`GradScaling`] (PyTorch's
/// `_fused_sgd_` with `grad_scale=` and `found_inf=`), decided on the device. A skipped
/// `first_step` leaves new momentum buffers as they were (uninitialized for `empty_like`
/// ones): callers that may skip a first step should pass zero-filled buffers and, with
/// `dampening == 0`, `first_step = false`, which computes the same `buf = g`.
pub fn sgd_scaled_(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
    scaling: GradScaling<'_>,
) -> Result<()> {
    let observed: Vec<&Tensor> = params.iter().collect();
    dispatch::call_list(&policy::FUSED_SGD, &observed, |_| {
        sgd_scaled_prepared(params, grads, momentum_buffers, cfg, scaling)
    })
}

fn sgd_scaled_prepared(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
    scaling: GradScaling<'_>,
) -> Result<()> {
    const OP: &str = "sgd_";
    let has_momentum = cfg.momentum != 0.0;
    let bufs = match (has_momentum, momentum_buffers) {
        (true, Some(b)) => b,
        (true, None) => {
            return Err(Error::invalid(
                OP,
                "momentum != 0 needs momentum_buffers (one tensor per parameter; pass first_step = true for new ones)",
            ))
        }
        (false, _) => &[],
    };
    let mut lists = vec![
        List {
            name: "parameter",
            tensors: params,
            written: true,
        },
        List {
            name: "gradient",
            tensors: grads,
            written: scaling.grad_scale.is_some(),
        },
    ];
    if has_momentum {
        lists.push(List {
            name: "momentum_buffer",
            tensors: bufs,
            written: true,
        });
    }
    let Some((dtype, device)) = check(OP, &lists)? else {
        return Ok(());
    };
    let param_lists = lists.len();
    let [scale_at, found_at] = scaling_lists(OP, &scaling, device, &mut lists)?;
    check_distinct(OP, &lists)?;
    let scalars = SgdScalars {
        lr: cfg.lr,
        momentum: cfg.momentum,
        one_minus_dampening: 1.0 - cfg.dampening,
        weight_decay: cfg.weight_decay,
        nesterov: cfg.nesterov,
        maximize: cfg.maximize,
        first_step: cfg.first_step,
    };
    let mut guards = lock_all(&lists);
    match device {
        Device::Cpu => {
            if let Some(at) = found_at {
                if cpu_f32(&guards[at][0], &lists[at].tensors[0]) != 0.0 {
                    return Ok(());
                }
            }
            let grad_scale = scale_at.map(|at| cpu_f32(&guards[at][0], &lists[at].tensors[0]) as f64);
            fn run<T: OptimElement>(
                guards: &mut [Vec<Guard<'_>>],
                lists: &[List<'_>],
                s: &SgdScalars,
                grad_scale: Option<f64>,
            ) {
                let (gp, rest) = guards.split_first_mut().expect("params list");
                let (gg, rest) = rest.split_first_mut().expect("grads list");
                let p = slices_mut::<T>(gp, lists[0].tensors);
                let g = grads_in::<T>(gg, lists[1].tensors, grad_scale);
                let mut b = rest
                    .first_mut()
                    .map(|gb| slices_mut::<T>(gb, lists[2].tensors).into_iter());
                let tensors = p
                    .into_iter()
                    .zip(g)
                    .map(|(param, grad)| SgdTensor {
                        param,
                        grad,
                        momentum_buffer: b.as_mut().and_then(|it| it.next()),
                    })
                    .collect();
                cpu_optim::sgd::<T>(tensors, s);
            }
            let param_guards = &mut guards[..param_lists];
            with_float_type!(dtype, run(param_guards, &lists, &scalars, grad_scale));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ptrs: Vec<Vec<u64>> = guards
                .iter()
                .zip(&lists)
                .map(|(g, l)| device_ptrs(g, l.tensors))
                .collect();
            let tensors: Vec<OptimTensor> = (0..params.len())
                .map(|i| {
                    let mut p = [0u64; 6];
                    for (k, list) in ptrs[..param_lists].iter().enumerate() {
                        p[k] = list[i];
                    }
                    OptimTensor {
                        ptrs: p,
                        numel: params[i].numel(),
                        scalars: [0.0; 2],
                    }
                })
                .collect();
            let flags = cfg.nesterov as i32 | (cfg.maximize as i32) << 1 | (cfg.first_step as i32) << 2;
            let kernel = OptimKernel::Sgd {
                lr: cfg.lr,
                momentum: cfg.momentum,
                one_minus_dampening: scalars.one_minus_dampening,
                weight_decay: cfg.weight_decay,
                grad_scale: scale_at.map_or(0, |at| ptrs[at][0]),
                found_inf: found_at.map_or(0, |at| ptrs[at][0]),
                flags,
            };
            let r = multi_tensor_step(ordinal, dtype, &tensors, kernel);
            drop(guards);
            r
        }
    }
}
