//! Optimizers (`torch.optim`): the [`Optimizer`] trait, [`SGD`], [`Adam`] and [`AdamW`],
//! parameter groups ([`ParamGroup`]), gradient clipping, and learning-rate schedulers.
//!
//! Every optimizer holds one or more parameter groups (`new` makes one of the parameters
//! given, in that order; `with_groups` and `add_param_group` make more, each with its own
//! hyperparameters: Note [Param groups] in `param_group.rs`) and updates the parameters in
//! place under `no_grad` with ember-core's in-place ops, so the same code runs on the CPU and
//! on CUDA. Parameters whose `.grad` is `None` are skipped, as in PyTorch, and get no state
//! until they first have a gradient.
//!
//! Note [Foreach step functions]: each algorithm is one free function ([`sgd::sgd`],
//! [`adam::adam`]) taking slices of parameters, gradients and state tensors, called once per
//! `step()` and param group, for the group's parameters that have a gradient (PyTorch's
//! `foreach` shape, with the group's hyperparameters). Inside, the parameters are bucketed by
//! device and dtype and each bucket is one call of ember-core's fused multi-tensor step
//! (`ember_core::fused::{adam_, sgd_}`: a few kernel launches on CUDA, one rayon loop on the
//! CPU); a parameter whose tensors the fused step does not take (not contiguous, a gradient of
//! another dtype, storages shared within the bucket) goes through the per-tensor path of
//! composed tensor ops instead. Both follow PyTorch's
//! `_single_tensor_*` functions op for op, and give the same bits in f32 and f64, so f64
//! results agree with PyTorch to rounding (~1e-15 relative per step).
//!
//! Note [State dict format]: [`Optimizer::state_dict`] returns a flat list of named tensors,
//! the names following the nesting of PyTorch's `optimizer.state_dict()`:
//! - `state.{i}.{name}` for parameter `i` (its index across all groups, group 0's first:
//!   PyTorch's numbering, [`Optimizer::params`]' order): `step` (Adam/AdamW; a 0-d f32 tensor
//!   on the CPU, as PyTorch's default), `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` (with
//!   `amsgrad`), `momentum_buffer` (SGD with `momentum != 0`). A parameter that never had a
//!   gradient has no entries.
//! - for each group `g`, `param_groups.{g}.{key}` for every key of PyTorch's
//!   `param_groups[g]`, in its order: `params` (1-d i64, the indices `i` of the group's
//!   parameters), then every hyperparameter of the group's config under PyTorch's name, then
//!   `initial_lr` once an LR scheduler has recorded it. Adam/AdamW: `lr`, `betas`, `eps`,
//!   `weight_decay`, `amsgrad`, `maximize`, `fused`; SGD: `lr`, `momentum`, `dampening`,
//!   `weight_decay`, `nesterov`, `maximize`. Numbers are 0-d f64 tensors, `betas` a 1-d f64
//!   tensor of two, switches 0-d bool tensors, and `fused` (PyTorch's `Optional[bool]`) a 0-d
//!   bool tensor or, for `None`, a 1-d bool tensor of no elements. PyTorch's `foreach`,
//!   `capturable` and `differentiable` are not written: ember has no such switches (`fused`
//!   is its one choice of step path; its CUDA steps read lr and step counts on the device, as
//!   PyTorch's capturable ones do, Note [Learning rate on the device]; no step is
//!   differentiable).
//!
//! Loading checks the groups first, as PyTorch does: a state dict with any `param_groups`
//! entry must have the optimizer's number of groups, and each group's `params` the size of the
//! optimizer's group, else a typed error that says what to do
//! ([`StateDictError::ParamGroupCount`], [`StateDictError::ParamGroupSize`]). Then each
//! group's hyperparameters are replaced by the state dict's (PyTorch's `load_state_dict`
//! replaces the group dicts; the optimizer's `defaults` stay), checked as the constructor
//! checks them; an entry of another kind or name, or values the constructor refuses, is an
//! error naming the entry, and nothing changes. A hyperparameter the state dict lacks keeps
//! the group's value: state dicts written before the groups kept them all (`params`, `lr` and
//! `initial_lr` only) and before groups existed (one group, no `params` entry) load as before.
//!
//! [`StateDictError::ParamGroupCount`]: crate::state_dict::StateDictError::ParamGroupCount
//! [`StateDictError::ParamGroupSize`]: crate::state_dict::StateDictError::ParamGroupSize
//!
//! The state tensors are returned as shared handles, as PyTorch's `state_dict()` does (except
//! an Adam `step` kept on the device, which is returned as a CPU copy);
//! [`Optimizer::load_state_dict`] copies what it loads (casting to each parameter's dtype and
//! device, except `step`, which may come from any device) and replaces the whole state, so
//! later steps never write into the caller's tensors.
//!
//! Note [Learning rate on the device]: [`SGD`], [`Adam`] and [`AdamW`] keep each param group's
//! learning rate on the host (`group_lr`, the state dict) and, for parameters on a GPU, also
//! in a 0-d f64 tensor per group on that GPU (`DeviceLr`) that the fused steps read there (`lr`
//! of `ember_core::fused::{adam_scaled_, sgd_scaled_}`). [`Optimizer::set_group_lr`] and
//! [`Optimizer::set_lr`] (what LR schedulers call) write the new value into the group's tensor
//! on the current stream, so a step recorded into a CUDA graph uses the lr of the moment it is
//! replayed, and an eager step uses the same bits as before (Note [Capturable optimizer steps]
//! in ember-core's `cuda_backend/optim.rs`). Adam's step counts live on the parameter's device
//! for the same reason (see `adam.rs`). CPU parameters read the host value, as before.
//!
//! Note [Steps under a GradScaler]: `ember_nn::amp::GradScaler` steps an optimizer through
//! [`Optimizer::step_scaled`], handing it the scale the gradients carry (or none when they were
//! unscaled already) and a found-inf flag, both 0-d f32 tensors on the device. [`SGD`], [`Adam`]
//! and [`AdamW`] declare [`Optimizer::supports_amp_scaling`]: their fused steps divide by the
//! scale and skip on the device (PyTorch's `_step_supports_amp_scaling` optimizers), and Adam
//! moves its step counts to the parameters' device for that, so the host never waits for the
//! GPU. Parameters that the fused steps do not take (see Note [Foreach step functions]) make
//! the step read the flag on the host, once. Other optimizers get the default, PyTorch's
//! generic path: the flag is read on the host and `step()` skipped when it is set.

pub mod adam;
pub mod clip;
pub mod lr_scheduler;
pub mod param_group;
pub mod sgd;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::{clip_grad_norm_, clip_grad_value_};
pub use lr_scheduler::{
    ChainedScheduler, CosineAnnealingLR, EpochScheduler, LRScheduler, LinearLR, SequentialLR, StepLR,
};
pub use param_group::{Group, ParamGroup};
pub use sgd::{SgdConfig, SGD};

/// Helpers of the optimizers' unit tests: a CPU f64 parameter and its gradient.
#[cfg(test)]
mod testing {
    use ember_core::{Device, Tensor};

    pub(crate) fn param(values: &[f64]) -> Tensor {
        Tensor::from_slice(values, [values.len()], Device::Cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap()
    }

    pub(crate) fn set_grad(p: &Tensor, values: &[f64]) {
        p.set_grad(Some(
            Tensor::from_slice(values, [values.len()], Device::Cpu).unwrap(),
        ))
        .unwrap();
    }
}

use crate::state_dict::StateDictResult;
use ember_core::{DType, Device, Error, Result, Tensor};

/// An optimizer over one or more groups of parameters (`torch.optim.Optimizer`).
///
/// The lr methods come in two forms: per group ([`Optimizer::group_lr`] and the other
/// `group_*` methods, PyTorch's `optimizer.param_groups[g]["lr"]`, what LR schedulers use),
/// and the single-value form, [`Optimizer::lr`] (group 0's) and [`Optimizer::set_lr`] (every
/// group's), which is all an optimizer of one group needs. The `group_*` methods default to
/// the single-value form, for an implementation with one group.
pub trait Optimizer {
    /// Performs one update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// The parameters of all groups, group 0's first, each group's in the order given (the
    /// numbering of the state dict, Note [State dict format]).
    fn params(&self) -> &[Tensor];

    /// True when [`Optimizer::step_scaled`] divides by the grad scale and skips on the device,
    /// so a GradScaler need not unscale first nor read the found-inf flag on the host
    /// (PyTorch's `_step_supports_amp_scaling`); see Note [Steps under a GradScaler].
    fn supports_amp_scaling(&self) -> bool {
        false
    }

    /// One step under a GradScaler (see Note [Steps under a GradScaler]): the gradients are
    /// scaled by `grad_scale` (`None`: already unscaled), and when `found_inf` is nonzero
    /// nothing may change (parameters, state, step counts). Both are 0-d f32 tensors.
    ///
    /// The default reads `found_inf` on the host (a synchronization on CUDA) and, when it is 0,
    /// divides the gradients by `grad_scale` and calls [`Optimizer::step`].
    fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> Result<()> {
        if found_inf.item_f64()? != 0.0 {
            return Ok(());
        }
        if let Some(scale) = grad_scale {
            let _g = ember_core::no_grad();
            for g in self.params().iter().filter_map(|p| p.grad()) {
                g.div_(&scale.to(g.device())?)?;
            }
        }
        self.step()
    }

    /// Releases the gradient of every parameter (`zero_grad(set_to_none=True)`, PyTorch 2's
    /// default).
    fn zero_grad(&mut self) -> Result<()>;

    /// The learning rate of group 0 (`optimizer.param_groups[0]["lr"]`); with several groups
    /// see [`Optimizer::group_lr`].
    fn lr(&self) -> f64;

    /// Sets the learning rate of every group to `lr` (nanoGPT's
    /// `for g in optimizer.param_groups: g["lr"] = lr`). LR schedulers scale each group from
    /// its own `initial_lr` through [`Optimizer::set_group_lr`] instead.
    fn set_lr(&mut self, lr: f64);

    /// The `initial_lr` of group 0: the lr recorded by the first LR scheduler built on this
    /// optimizer, `None` before.
    fn initial_lr(&self) -> Option<f64>;

    /// Records `lr` as the `initial_lr` of every group (see [`Optimizer::initial_lr`]; LR
    /// schedulers record each group's own through [`Optimizer::set_group_initial_lr`]).
    fn set_initial_lr(&mut self, lr: f64);

    /// The number of param groups (`len(optimizer.param_groups)`).
    fn num_param_groups(&self) -> usize {
        1
    }

    /// The learning rate of group `group`.
    ///
    /// # Panics
    /// When `group >= self.num_param_groups()`, as indexing does.
    fn group_lr(&self, group: usize) -> f64 {
        assert_eq!(group, 0, "param group {group} of an optimizer with one group");
        self.lr()
    }

    /// Sets the learning rate of group `group` (what LR schedulers call).
    ///
    /// # Panics
    /// When `group >= self.num_param_groups()`.
    fn set_group_lr(&mut self, group: usize, lr: f64) {
        assert_eq!(group, 0, "param group {group} of an optimizer with one group");
        self.set_lr(lr)
    }

    /// The `initial_lr` of group `group` (`None` before an LR scheduler recorded it).
    ///
    /// # Panics
    /// When `group >= self.num_param_groups()`.
    fn group_initial_lr(&self, group: usize) -> Option<f64> {
        assert_eq!(group, 0, "param group {group} of an optimizer with one group");
        self.initial_lr()
    }

    /// Records the `initial_lr` of group `group` (LR schedulers call this).
    ///
    /// # Panics
    /// When `group >= self.num_param_groups()`.
    fn set_group_initial_lr(&mut self, group: usize, lr: f64) {
        assert_eq!(group, 0, "param group {group} of an optimizer with one group");
        self.set_initial_lr(lr)
    }

    /// Appends a param group (`optimizer.add_param_group`), numbered after the parameters
    /// already held (Note [Param groups]). The default refuses: an optimizer of fixed
    /// parameters; [`SGD`], [`Adam`] and [`AdamW`] take groups.
    fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        let _ = group;
        Err(Error::invalid(
            "add_param_group",
            "this optimizer does not take more param groups; build it over every parameter",
        ))
    }

    /// The learning rate of every group, in order (what PyTorch's schedulers'
    /// `get_last_lr()` lists).
    fn group_lrs(&self) -> Vec<f64> {
        (0..self.num_param_groups()).map(|g| self.group_lr(g)).collect()
    }

    /// The entries of param group `group` in [`Optimizer::state_dict`] but `params`, unprefixed
    /// (`("lr", ..)`, `("betas", ..)`, ...: PyTorch's `param_groups[group]` without `"params"`;
    /// Note [State dict format]): what `ZeroRedundancyOptimizer` puts in the state dict it
    /// consolidates. The default holds `lr` and, when set, `initial_lr`, as
    /// [`Optimizer::state_dict`] of an optimizer without other hyperparameters would.
    ///
    /// # Panics
    /// When `group >= self.num_param_groups()`.
    fn param_group_state(&self, group: usize) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut push = |name: &str, v: f64| {
            if let Ok(t) = Tensor::scalar(v, DType::F64, Device::Cpu) {
                out.push((name.to_owned(), t));
            }
        };
        push("lr", self.group_lr(group));
        if let Some(v) = self.group_initial_lr(group) {
            push("initial_lr", v);
        }
        out
    }

    /// The optimizer state as named tensors; see Note [State dict format] in this module.
    fn state_dict(&self) -> Vec<(String, Tensor)>;

    /// Replaces the state with `state` (the format of [`Optimizer::state_dict`]), copying it.
    /// Checks everything before it changes anything: a failed load leaves the state as it was.
    /// A state dict of other param groups is
    /// [`StateDictError::ParamGroupCount`](crate::state_dict::StateDictError::ParamGroupCount)
    /// or [`ParamGroupSize`](crate::state_dict::StateDictError::ParamGroupSize); other errors
    /// are [`Tensor`](crate::state_dict::StateDictError::Tensor).
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()>;
}

/// The tensor of `lrs` on `device`, if any.
pub(crate) fn lr_on(lrs: &[Tensor], device: Device) -> Option<&Tensor> {
    lrs.iter().find(|t| t.device() == device)
}

/// One parsed key of a state dict.
pub(crate) enum StateKey<'a> {
    /// `state.{index}.{name}` (the index not yet checked against the parameter count).
    Param { index: usize, name: &'a str },
    /// `param_groups.{group}.{name}`.
    Group { group: usize, name: &'a str },
}

/// Parses `key` (see Note [State dict format]).
pub(crate) fn parse_state_key<'a>(op: &'static str, key: &'a str) -> Result<StateKey<'a>> {
    let bad = || {
        Error::invalid(
            op,
            format!("unexpected key {key:?} in state dict: expected \"state.<param index>.<name>\" or \"param_groups.<group index>.<name>\""),
        )
    };
    let split = |rest: &'a str| -> Result<(usize, &'a str)> {
        let (index, name) = rest.split_once('.').ok_or_else(bad)?;
        Ok((index.parse().map_err(|_| bad())?, name))
    };
    if let Some(rest) = key.strip_prefix("state.") {
        let (index, name) = split(rest)?;
        return Ok(StateKey::Param { index, name });
    }
    if let Some(rest) = key.strip_prefix("param_groups.") {
        let (group, name) = split(rest)?;
        return Ok(StateKey::Group { group, name });
    }
    Err(bad())
}

/// Errors unless parameter `index` of a state dict is one of the optimizer's `num_params`.
pub(crate) fn check_state_index(op: &'static str, index: usize, name: &str, num_params: usize) -> Result<()> {
    if index < num_params {
        return Ok(());
    }
    Err(Error::invalid(
        op,
        format!("state dict key \"state.{index}.{name}\" names parameter {index}, but the optimizer has {num_params} parameters"),
    ))
}

/// A copy of a loaded state tensor in the dtype, device and shape of `param`.
pub(crate) fn load_like_param(op: &'static str, value: &Tensor, param: &Tensor) -> Result<Tensor> {
    if value.shape() != param.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: param.shape().clone(),
            rhs: value.shape().clone(),
            hint: "a state tensor must have its parameter's shape",
        });
    }
    let _g = ember_core::no_grad();
    value.to_dtype(param.dtype())?.to(param.device())?.deep_clone()
}

/// Checks the parameter list given to an optimizer: non-empty, and leaves only.
pub(crate) fn check_params(op: &'static str, params: &[Tensor]) -> Result<()> {
    if params.is_empty() {
        return Err(Error::invalid(op, "optimizer got an empty parameter list"));
    }
    if let Some(i) = params.iter().position(|p| !p.is_leaf()) {
        return Err(Error::invalid(
            op,
            format!("can't optimize a non-leaf Tensor (parameter {i}); pass x.detach().requires_grad_(true) instead"),
        ));
    }
    Ok(())
}

/// Errors unless `value >= 0` (NaN fails), with PyTorch's message.
pub(crate) fn check_non_negative(op: &'static str, what: &str, value: f64) -> Result<()> {
    if value >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(op, format!("Invalid {what}: {value}")))
    }
}

/// The parameters of one step split for Note [Foreach step functions]: groups of indices that
/// one fused call takes (one device and dtype each), and the indices left to the per-tensor
/// path (ascending).
pub(crate) struct FusedGroups {
    pub(crate) fused: Vec<Vec<usize>>,
    pub(crate) single: Vec<usize>,
}

/// Splits parameters `0..n` into fused groups and per-tensor ones. `tensors_of(i)` lists the
/// tensors of parameter `i` (parameter first, then gradient and state tensors); a parameter is
/// fused when they are all contiguous, of the parameter's floating dtype and device, and its
/// whole group passes `ember_core::fused::can_fuse_reading`: no storage the step writes is
/// shared, while gradients the step only reads (`grads_read`: no grad scale divides them) may
/// share one, as a sharded model's views of its reduce-scatter buffer do.
pub(crate) fn fused_groups<'a>(
    n: usize,
    grads_read: bool,
    tensors_of: impl Fn(usize) -> Vec<&'a Tensor>,
) -> FusedGroups {
    let mut keyed: Vec<((Device, DType), Vec<usize>)> = Vec::new();
    let mut single = Vec::new();
    for i in 0..n {
        let ts = tensors_of(i);
        let key = (ts[0].device(), ts[0].dtype());
        let ok = key.1.is_floating_point()
            && ts
                .iter()
                .all(|t| (t.device(), t.dtype()) == key && t.is_contiguous());
        if !ok {
            single.push(i);
            continue;
        }
        match keyed.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(i),
            None => keyed.push((key, vec![i])),
        }
    }
    let mut fused = Vec::new();
    for (_, group) in keyed {
        let (mut written, mut read) = (Vec::new(), Vec::new());
        for &i in &group {
            for (k, t) in tensors_of(i).into_iter().enumerate() {
                if k == 1 && grads_read {
                    read.push(t);
                } else {
                    written.push(t);
                }
            }
        }
        if ember_core::fused::can_fuse_reading(&written, &read) {
            fused.push(group);
        } else {
            single.extend(group);
        }
    }
    single.sort_unstable();
    FusedGroups { fused, single }
}

/// Whether a step under a GradScaler is skipped, read on the host (a synchronization on
/// CUDA): the fallback of Note [Steps under a GradScaler] for what the device cannot decide.
/// False without a flag.
pub(crate) fn found_inf_on_host(found_inf: Option<&Tensor>) -> Result<bool> {
    match found_inf {
        Some(f) => Ok(f.item_f64()? != 0.0),
        None => Ok(false),
    }
}

/// The tensors of a [`GradScaling`](ember_core::fused::GradScaling) on `device` (one fused
/// group's; copies where the scaler keeps them on another device).
pub(crate) struct ScalingOn(Option<Tensor>, Option<Tensor>);

impl ScalingOn {
    pub(crate) fn new(scaling: &ember_core::fused::GradScaling<'_>, device: Device) -> Result<ScalingOn> {
        let on = |t: Option<&Tensor>| t.map(|t| t.to(device)).transpose();
        Ok(ScalingOn(on(scaling.grad_scale)?, on(scaling.found_inf)?))
    }

    pub(crate) fn get(&self) -> ember_core::fused::GradScaling<'_> {
        ember_core::fused::GradScaling {
            grad_scale: self.0.as_ref(),
            found_inf: self.1.as_ref(),
        }
    }
}

/// Divides `grad` in place by `grad_scale` (the per-tensor path's share of a scaled step; the
/// fused steps do it in their kernels).
pub(crate) fn unscale_grad(grad: &Tensor, grad_scale: Option<&Tensor>) -> Result<()> {
    if let Some(s) = grad_scale {
        grad.div_(&s.to(grad.device())?)?;
    }
    Ok(())
}

/// Sets the gradient of every parameter to `None`.
pub(crate) fn zero_grads(params: &[Tensor]) -> Result<()> {
    params.iter().try_for_each(|p| p.set_grad(None))
}
