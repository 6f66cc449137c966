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
//! with `bias_correction{1,2} = 1 - beta{1,2}^step` computed on the host in f64 from each
//! parameter's own step count (so no host synchronization). Hyperparameters are cast to the
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
use crate::backend::{OptimKernel, OptimOperands};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};
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
                return Err(Error::DeviceMismatch {
                    op,
                    lhs: device,
                    rhs: t.device(),
                });
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

/// One [`OptimOperands`] per parameter from the guards of `lists` (parameters, gradients, then
/// the state lists in the kernel's order), each with its per-tensor `scalars`.
fn operands<'g>(
    guards: &'g mut [Vec<Guard<'_>>],
    lists: &[List<'_>],
    scalars: impl Fn(usize) -> [f64; 2],
) -> Vec<OptimOperands<'g, Storage>> {
    let mut lanes: Vec<_> = guards.iter_mut().map(|g| g.iter_mut()).collect();
    let params = lists[0].tensors;
    (0..params.len())
        .map(|i| {
            let mut next = |k: usize| lanes.get_mut(k).map(|l| l.next().expect("one guard per tensor"));
            let param = next(0).expect("params list").storage_mut();
            let grad: &'g Guard<'_> = next(1).expect("grads list");
            let grad = grad.storage();
            let state = [next(2), next(3), next(4)].map(|g| g.map(Guard::storage_mut));
            let mut offsets = [0; 5];
            for (k, l) in lists.iter().enumerate() {
                offsets[k] = l.tensors[i].storage_offset();
            }
            OptimOperands {
                param,
                grad,
                state,
                offsets,
                numel: params[i].numel(),
                scalars: scalars(i),
            }
        })
        .collect()
}

/// One Adam (or, with `decoupled_weight_decay`, AdamW) step of every `params[i]` in place,
/// updating `exp_avgs[i]`, `exp_avg_sqs[i]` and, with `amsgrad`, `max_exp_avg_sqs[i]`;
/// `steps[i]` is parameter i's step count after this step (1 on the first). See the module docs
/// for the formula and Note [Fused step preconditions] for what the tensors must satisfy.
pub fn adam_(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    max_exp_avg_sqs: Option<&[Tensor]>,
    steps: &[f64],
    cfg: &AdamStep,
) -> Result<()> {
    const OP: &str = "adam_";
    if steps.len() != params.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "expected one step count per parameter ({}), got {}",
                params.len(),
                steps.len()
            ),
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
            written: false,
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
    let Some((dtype, _device)) = check(OP, &lists)? else {
        return Ok(());
    };
    // Step size and sqrt(bias_correction2) of each parameter, as `_single_tensor_adam`.
    let per_tensor: Vec<[f64; 2]> = steps
        .iter()
        .map(|&step| {
            let bias_correction1 = 1.0 - cfg.beta1.powf(step);
            let bias_correction2 = 1.0 - cfg.beta2.powf(step);
            [cfg.lr / bias_correction1, bias_correction2.sqrt()]
        })
        .collect();
    let flags = cfg.amsgrad as i32 | (cfg.maximize as i32) << 1 | (cfg.decoupled_weight_decay as i32) << 2;
    let kernel = OptimKernel::Adam {
        lr: cfg.lr,
        one_minus_beta1: 1.0 - cfg.beta1,
        beta2: cfg.beta2,
        one_minus_beta2: 1.0 - cfg.beta2,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
        decay: 1.0 - cfg.lr * cfg.weight_decay,
        flags,
    };
    // The guards are held until the backend has run (CPU) or enqueued (CUDA) the whole step.
    let mut guards = lock_all(&lists);
    Storage::optim_step(&kernel, dtype, operands(&mut guards, &lists, |i| per_tensor[i]))
}

/// One SGD step of every `params[i]` in place from `grads[i]`, updating
/// `momentum_buffers[i]` when `momentum != 0` (the buffers are then required; with
/// `first_step` they are overwritten with the gradient). See the module docs for the formula and
/// Note [Fused step preconditions] for what the tensors must satisfy.
pub fn sgd_(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
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
            written: false,
        },
    ];
    if has_momentum {
        lists.push(List {
            name: "momentum_buffer",
            tensors: bufs,
            written: true,
        });
    }
    let Some((dtype, _device)) = check(OP, &lists)? else {
        return Ok(());
    };
    let flags = cfg.nesterov as i32 | (cfg.maximize as i32) << 1 | (cfg.first_step as i32) << 2;
    let kernel = OptimKernel::Sgd {
        lr: cfg.lr,
        momentum: cfg.momentum,
        one_minus_dampening: 1.0 - cfg.dampening,
        weight_decay: cfg.weight_decay,
        flags,
    };
    let mut guards = lock_all(&lists);
    Storage::optim_step(&kernel, dtype, operands(&mut guards, &lists, |_| [0.0; 2]))
}
