//! Fused multi-tensor optimizer steps (`torch._fused_adam_`, `torch._fused_sgd_`): [`adam_`]
//! (Adam and AdamW) and [`sgd_`] update many parameters and their state tensors in place in a
//! few kernel launches (48 tensors a launch on CUDA) or one rayon loop on the CPU, instead of
//! several tensor ops per parameter. This file checks the tensors, locks their storages and
//! hands them to the backend as one list of operands ([`AdamTensor`], [`SgdTensor`] in
//! `backend/step.rs`; `OptimOps::adam_step` / `sgd_step`).
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
//! PyTorch's `_fused_adam_(..., grad_scale=, found_inf=)`; both are read on the device. The
//! learning rate may live in a device tensor too (the `lr` argument of the `_scaled_` forms,
//! PyTorch's tensor `lr=`), read by the kernels at every step, which makes a CUDA graph of the
//! step follow an LR scheduler (Note [Capturable optimizer steps] in `cuda_backend/optim.rs`); the
//! results are the same bits as with `cfg.lr`. Hyperparameters are cast to the
//! arithmetic type (f32 for f32/f16/bf16, f64 for f64); f16/bf16 are computed in f32 and rounded
//! once on store, as PyTorch's fused kernels do. For f32 and f64 the results are the same bits
//! as the composed per-tensor ops, on both devices.
//!
//! Note [Fused step preconditions]: every tensor of one call is contiguous, of one floating
//! dtype and one device (group by device and dtype first, as PyTorch's
//! `_group_tensors_by_device_and_dtype`), each state tensor and gradient has its parameter's
//! shape, and no tensor the step writes shares a storage with another tensor of the call (the
//! call locks every storage once, in a global order, for the whole update). Tensors the step
//! only reads may share storages: the gradients of a fully sharded model are views of the one
//! buffer its reduce-scatter wrote (`fsdp_gpt2`'s 148 of them went to the per-tensor step while
//! this was refused; docs/benchmarks.md, session 49). [`can_fuse`] answers whether a set of
//! tensors, all written, qualifies, and [`can_fuse_reading`] one whose gradients are only read;
//! the steps return a typed error otherwise. The updates write in place: each written storage's
//! version is bumped once, as by any in-place op, and nothing is recorded by autograd; as with
//! other in-place ops, writing a tensor that requires grad is an error unless grad mode is off
//! (optimizers run under `no_grad`).

use super::amp_scaling::{check_scalar, check_writable};
pub use super::amp_scaling::{foreach_mul_, foreach_norm};
pub use super::norm::add_layer_norm;
use crate::autograd;
pub use crate::backend::{AdamStep, SgdStep};
use crate::backend::{AdamTensor, Arrival, Elems, GradElems, SgdTensor, StepCount, StepScalars};
use crate::dispatch::{self, policy};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// True when `tensors` satisfy Note [Fused step preconditions] as one group: all contiguous,
/// of one floating dtype, on one device, no two sharing a storage. (Shapes are checked by the
/// steps themselves.)
pub fn can_fuse(tensors: &[&Tensor]) -> bool {
    can_fuse_reading(tensors, &[])
}

/// As [`can_fuse`] for a step that writes `written` and only reads `read` (the gradients of a
/// step without a grad scale): every tensor contiguous, of one floating dtype, on one device,
/// and no written tensor sharing a storage with any other; the read ones may share theirs.
pub fn can_fuse_reading(written: &[&Tensor], read: &[&Tensor]) -> bool {
    let Some(first) = written.first().or(read.first()) else {
        return true;
    };
    let (dtype, device) = (first.dtype(), first.device());
    if !dtype.is_floating_point() {
        return false;
    }
    let uniform = written
        .iter()
        .chain(read)
        .all(|t| t.dtype() == dtype && t.device() == device && t.is_contiguous());
    let ids = written
        .iter()
        .map(|t| (t.storage().id(), true))
        .chain(read.iter().map(|t| (t.storage().id(), false)));
    uniform && !shares_a_written_storage(ids)
}

/// Whether a storage of the `(storage id, written)` operands is written and named twice.
fn shares_a_written_storage(ids: impl Iterator<Item = (usize, bool)>) -> bool {
    let mut ids: Vec<(usize, bool)> = ids.collect();
    ids.sort_unstable();
    ids.windows(2).any(|w| w[0].0 == w[1].0 && (w[0].1 || w[1].1))
}

/// One list of tensors of a call, and whether the step writes it.
struct List<'a> {
    name: &'static str,
    tensors: &'a [Tensor],
    written: bool,
}

/// Checks Note [Fused step preconditions] for `lists` (the first is the parameters) and the
/// autograd rule of in-place writes; returns the device of the group, `None` when there are no
/// parameters.
fn check(op: &'static str, lists: &[List<'_>]) -> Result<Option<Device>> {
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
    check_distinct(op, lists)?;
    Ok(Some(device))
}

/// A held lock on one storage (also `foreach.rs`'s).
pub(super) enum Guard<'a> {
    Read(RwLockReadGuard<'a, Storage>),
    Write(RwLockWriteGuard<'a, Storage>),
}

impl Guard<'_> {
    pub(super) fn storage(&self) -> &Storage {
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

/// The locks of one call: each written list's storages, one guard per tensor (a written
/// storage is named once in the call), and every storage only read, once however many tensors
/// of the read lists name it.
struct Locked<'a> {
    written: Vec<Vec<Guard<'a>>>,
    read: Vec<Guard<'a>>,
    /// Per read list, each tensor's index into `read`.
    read_at: Vec<Vec<usize>>,
}

/// Locks every storage of `lists` once (write locks, bumping the version, for written lists),
/// in the order of their storage ids so that two calls never wait on each other. [`check`]
/// made sure no written storage is named twice.
fn lock_all<'a>(lists: &[List<'a>]) -> Locked<'a> {
    let mut order: Vec<(usize, usize, usize)> = Vec::new();
    for (li, l) in lists.iter().enumerate() {
        for (ti, t) in l.tensors.iter().enumerate() {
            order.push((t.storage().id(), li, ti));
        }
    }
    order.sort_unstable();
    let mut written: Vec<Vec<Option<Guard<'a>>>> = lists
        .iter()
        .map(|l| {
            let n = if l.written { l.tensors.len() } else { 0 };
            (0..n).map(|_| None).collect()
        })
        .collect();
    let mut read_at: Vec<Vec<usize>> = lists
        .iter()
        .map(|l| {
            if l.written {
                Vec::new()
            } else {
                vec![0; l.tensors.len()]
            }
        })
        .collect();
    let mut read: Vec<Guard<'a>> = Vec::new();
    let mut last_read: Option<usize> = None;
    for (id, li, ti) in order {
        let storage = lists[li].tensors[ti].storage();
        if lists[li].written {
            written[li][ti] = Some(Guard::Write(storage.write()));
        } else {
            if last_read != Some(id) {
                read.push(Guard::Read(storage.read()));
                last_read = Some(id);
            }
            read_at[li][ti] = read.len() - 1;
        }
    }
    let written = written
        .into_iter()
        .map(|l| {
            l.into_iter()
                .map(|g| g.expect("every written tensor was locked"))
                .collect()
        })
        .collect();
    Locked {
        written,
        read,
        read_at,
    }
}

/// Hands out the locked lists of a call, in the order of its `lists`, as step operands.
struct Operands<'g, 'a> {
    written: std::slice::IterMut<'g, Vec<Guard<'a>>>,
    read: &'g [Guard<'a>],
    read_at: std::slice::Iter<'g, Vec<usize>>,
    lists: std::slice::Iter<'g, List<'a>>,
}

impl<'g, 'a> Operands<'g, 'a> {
    fn new(locked: &'g mut Locked<'a>, lists: &'g [List<'a>]) -> Self {
        Operands {
            written: locked.written.iter_mut(),
            read: &locked.read,
            read_at: locked.read_at.iter(),
            lists: lists.iter(),
        }
    }

    /// The elements of each tensor of the next list, written.
    fn written(&mut self) -> Vec<Elems<&'g mut Storage>> {
        let list = self.lists.next().expect("one list per lock list");
        let guards = self.written.next().expect("one guard list per list");
        self.read_at.next();
        debug_assert!(list.written);
        guards
            .iter_mut()
            .zip(list.tensors)
            .map(|(g, t)| Elems {
                storage: g.storage_mut(),
                offset: t.storage_offset(),
                len: t.numel(),
            })
            .collect()
    }

    /// The elements of each tensor of the next list, read.
    fn read(&mut self) -> Vec<Elems<&'g Storage>> {
        let list = self.lists.next().expect("one list per lock list");
        self.written.next();
        let at = self.read_at.next().expect("one index list per list");
        debug_assert!(!list.written);
        let read = self.read;
        at.iter()
            .zip(list.tensors)
            .map(|(&i, t)| Elems {
                storage: read[i].storage(),
                offset: t.storage_offset(),
                len: t.numel(),
            })
            .collect()
    }

    /// The gradients (the next list): written under a grad scale, else read.
    fn grads(&mut self, scaled: bool) -> Vec<GradElems<'g, Storage>> {
        if scaled {
            self.written().into_iter().map(GradElems::Unscaled).collect()
        } else {
            self.read().into_iter().map(GradElems::Read).collect()
        }
    }

    /// The grad scale, found-inf flag and lr that [`scalar_lists`] added, in the next lists.
    fn scalars(&mut self, scaling: &GradScaling<'_>, lr: Option<&Tensor>) -> StepScalars<'g, Storage> {
        let grad_scale = scaling.grad_scale.and_then(|_| self.read().pop());
        let found_inf = scaling.found_inf.and_then(|_| self.read().pop());
        let lr = lr.and_then(|_| self.read().pop());
        StepScalars {
            grad_scale,
            found_inf,
            lr,
        }
    }
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

/// Checks the grad scale, found-inf and lr tensors of a step on `device` and adds those
/// present to `lists` (read-only), in that order.
fn scalar_lists<'a>(
    op: &'static str,
    scaling: &GradScaling<'a>,
    lr: Option<&'a Tensor>,
    device: Device,
    lists: &mut Vec<List<'a>>,
) -> Result<()> {
    let named = [
        ("grad_scale", scaling.grad_scale, DType::F32),
        ("found_inf", scaling.found_inf, DType::F32),
        ("lr", lr, DType::F64),
    ];
    for (name, t, dtype) in named {
        let Some(t) = t else { continue };
        check_scalar(op, name, t, dtype, device)?;
        lists.push(List {
            name,
            tensors: std::slice::from_ref(t),
            written: false,
        });
    }
    Ok(())
}

/// Errors where a written storage of `lists` is shared with another tensor (see Note [Fused
/// step preconditions]).
fn check_distinct(op: &'static str, lists: &[List<'_>]) -> Result<()> {
    let ids = lists
        .iter()
        .flat_map(|l| l.tensors.iter().map(|t| (t.storage().id(), l.written)));
    if shares_a_written_storage(ids) {
        return Err(Error::invalid(
            op,
            "a tensor the step writes shares its storage with another; fused steps need each parameter, state tensor and step count in its own storage, and each gradient too under a grad scale (use the per-tensor step)",
        ));
    }
    Ok(())
}

/// Orders the current stream after every copy or arrival in row blocks still in flight into an
/// operand (Note [Copies in row blocks] in `storage/row_blocks.rs`): the dispatch point saw only
/// the parameters.
fn settle_operands(lists: &[List<'_>]) -> Result<()> {
    if !crate::storage::row_blocks::any_in_flight() {
        return Ok(());
    }
    let all: Vec<&Tensor> = lists.iter().flat_map(|l| l.tensors.iter()).collect();
    crate::dispatch::row_blocks::settle(&all, |_, _| false)
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
        None,
    )
}

/// [`adam_`] with the step counts on the host or the device ([`AdamSteps`]), under a
/// GradScaler the gradient scaling of [`GradScaling`] (PyTorch's `_fused_adam_` with
/// `grad_scale=` and `found_inf=`), and optionally the learning rate in a device tensor: `lr`,
/// a one-element f64 tensor on the parameters' device, is read where it lives instead of
/// `cfg.lr` (PyTorch's tensor `lr=`). With device steps nothing of the step reads a value back
/// to the host, so a skipped step is decided on the device; with device steps and a device lr
/// nothing that changes between steps is passed by value, so the step can be recorded into a
/// CUDA graph whose replays follow the lr (Note [Capturable optimizer steps] in
/// `cuda_backend/optim.rs`). The step tensors, grad scale, found-inf flag and lr are locked with the
/// others and must be in storages of their own.
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
    lr: Option<&Tensor>,
) -> Result<()> {
    let observed: Vec<&Tensor> = params.iter().collect();
    dispatch::call_list(&policy::FUSED_ADAM, &observed, |_, _| {
        adam_scaled_prepared(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            cfg,
            scaling,
            lr,
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
    lr: Option<&Tensor>,
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
    let Some(device) = check(OP, &lists)? else {
        return Ok(());
    };
    let device_steps = match steps {
        AdamSteps::Host(_) => false,
        AdamSteps::Device(s) => {
            for t in s {
                check_scalar(OP, "a device step count", t, DType::F32, device)?;
                check_writable(OP, "a device step count", t)?;
            }
            lists.push(List {
                name: "step count",
                tensors: s,
                written: true,
            });
            true
        }
    };
    scalar_lists(OP, &scaling, lr, device, &mut lists)?;
    check_distinct(OP, &lists)?;
    // Gradients arriving in row blocks are updated block by block (Note [Arrivals in row
    // blocks] in `storage/row_blocks.rs`); anything else in flight is waited for.
    let arrivals = grads
        .iter()
        .map(|g| {
            Ok(g.storage()
                .take_arriving_elements(g.layout(), g.device())?
                .unwrap_or_default())
        })
        .collect::<Result<Vec<_>>>()?;
    // Nothing read the arriving blocks (an error below): whatever comes next waits for them.
    let release = |arrivals| crate::storage::row_blocks::release_arrivals(device, arrivals);
    if let Err(e) = settle_operands(&lists) {
        release(&arrivals)?;
        return Err(e);
    }
    // Note [Cast twins] in `storage/mod.rs`: a float32 parameter that autocast cast to bf16
    // since its last step gets its bf16 twin written beside it by the step, on a GPU, without
    // amsgrad, with the whole gradient at hand, and not during a capture; nor with found_inf,
    // where a skipped step writes nothing, the twin included. During a capture the twin goes
    // into the buffer the captured cast wrote (Note [Casts a captured step keeps] in
    // `storage/graph_casts.rs`), which a skipped step leaves the cast of the unchanged values.
    let capturing = crate::storage::capture_underway();
    let twins_possible = device.is_cuda() && !cfg.amsgrad && arrivals.iter().all(Vec::is_empty);
    let want_twins = twins_possible && scaling.found_inf.is_none() && !capturing;
    // The float32 parameters that are all of their storage: the ones a twin can sit beside.
    let whole: Vec<bool> = params
        .iter()
        .map(|p| p.dtype() == DType::F32 && p.is_whole_storage())
        .collect();
    let graph_targets: Vec<Option<crate::storage::StorageRef>> = params
        .iter()
        .zip(&whole)
        .map(|(p, &whole)| {
            (twins_possible && capturing && whole)
                .then(|| crate::storage::graph_casts::step_target(p.storage()))
                .flatten()
        })
        .collect();
    let mut graph_guards: Vec<Option<RwLockWriteGuard<'_, Storage>>> = graph_targets
        .iter()
        .map(|t| t.as_ref().map(|t| t.write()))
        .collect();
    let mut twins = params
        .iter()
        .zip(&whole)
        .map(
            |(p, &whole)| match want_twins && whole && p.storage().wanted_twin() == Some(DType::BF16) {
                true => Storage::alloc(device, DType::BF16, p.numel()).map(Some),
                false => Ok(None),
            },
        )
        .collect::<Result<Vec<Option<Storage>>>>()?;
    let mut guards = lock_all(&lists);
    // The operands borrow the guards: every storage stays locked until the backend has run
    // (on CUDA, until every launch is enqueued).
    let mut ops = Operands::new(&mut guards, &lists);
    let p = ops.written();
    let g = ops.grads(scaling.grad_scale.is_some());
    let m = ops.written();
    let v = ops.written();
    let mut x = cfg.amsgrad.then(|| ops.written().into_iter());
    let mut counts = device_steps.then(|| ops.written().into_iter());
    let amp = ops.scalars(&scaling, lr);
    let mut twin_elems = twins.iter_mut().zip(graph_guards.iter_mut()).map(|(t, g)| {
        t.as_mut().or(g.as_deref_mut()).map(|s| Elems {
            len: s.len(),
            storage: s,
            offset: 0,
        })
    });
    let tensors = p
        .into_iter()
        .zip(g)
        .zip(m)
        .zip(v)
        .enumerate()
        .map(|(i, (((param, grad), exp_avg), exp_avg_sq))| AdamTensor {
            twin: twin_elems.next().flatten(),
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq: x.as_mut().and_then(Iterator::next),
            step: match (steps, counts.as_mut()) {
                (AdamSteps::Host(s), _) => StepCount::Host(s[i]),
                (AdamSteps::Device(_), Some(c)) => {
                    StepCount::Device(c.next().expect("one count per parameter"))
                }
                (AdamSteps::Device(_), None) => unreachable!("device steps are locked"),
            },
            arrivals: arrivals[i].iter().map(Arrival::as_ref).collect(),
        })
        .collect();
    let stepped = Storage::adam_step(cfg, tensors, amp);
    if stepped.is_err() {
        release(&arrivals)?;
    }
    stepped?;
    drop(guards);
    drop(graph_guards);
    for ((p, t), g) in params.iter().zip(twins).zip(&graph_targets) {
        if let Some(t) = t {
            p.storage().set_twin(t, false);
        }
        if g.is_some() {
            crate::storage::graph_casts::stepped(p.storage());
        }
    }
    Ok(())
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
    sgd_scaled_(params, grads, momentum_buffers, cfg, GradScaling::default(), None)
}

/// [`sgd_`] under a GradScaler: the gradient scaling of [`GradScaling`] (PyTorch's
/// `_fused_sgd_` with `grad_scale=` and `found_inf=`), decided on the device, and optionally
/// the learning rate in a one-element f64 tensor on the parameters' device, read there instead
/// of `cfg.lr` (see [`adam_scaled_`]). A skipped
/// `first_step` leaves new momentum buffers as they were (uninitialized for `empty_like`
/// ones): callers that may skip a first step should pass zero-filled buffers and, with
/// `dampening == 0`, `first_step = false`, which computes the same `buf = g`.
pub fn sgd_scaled_(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
    scaling: GradScaling<'_>,
    lr: Option<&Tensor>,
) -> Result<()> {
    let observed: Vec<&Tensor> = params.iter().collect();
    dispatch::call_list(&policy::FUSED_SGD, &observed, |_, _| {
        sgd_scaled_prepared(params, grads, momentum_buffers, cfg, scaling, lr)
    })
}

fn sgd_scaled_prepared(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: Option<&[Tensor]>,
    cfg: &SgdStep,
    scaling: GradScaling<'_>,
    lr: Option<&Tensor>,
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
    let Some(device) = check(OP, &lists)? else {
        return Ok(());
    };
    scalar_lists(OP, &scaling, lr, device, &mut lists)?;
    check_distinct(OP, &lists)?;
    settle_operands(&lists)?;
    let mut locked = lock_all(&lists);
    let mut ops = Operands::new(&mut locked, &lists);
    let p = ops.written();
    let g = ops.grads(scaling.grad_scale.is_some());
    let mut b = has_momentum.then(|| ops.written().into_iter());
    let amp = ops.scalars(&scaling, lr);
    let tensors = p
        .into_iter()
        .zip(g)
        .map(|(param, grad)| SgdTensor {
            param,
            grad,
            momentum_buffer: b.as_mut().and_then(Iterator::next),
        })
        .collect();
    Storage::sgd_step(cfg, tensors, amp)
}
