//! Optimizers (`torch.optim`): the [`Optimizer`] trait, [`SGD`], [`Adam`] and [`AdamW`],
//! gradient clipping, and learning-rate schedulers.
//!
//! Every optimizer holds one parameter group (its parameters in the order given to `new`) and
//! updates the parameters in place under `no_grad` with ember-core's in-place ops, so the same
//! code runs on the CPU and on CUDA. Parameters whose `.grad` is `None` are skipped, as in
//! PyTorch, and get no state until they first have a gradient.
//!
//! Note [Foreach step functions]: each algorithm is one free function ([`sgd::sgd`],
//! [`adam::adam`]) taking slices of parameters, gradients and state tensors, called once per
//! `step()` for all the parameters that have a gradient (PyTorch's `foreach` shape). Inside,
//! the parameters are grouped by device and dtype and each group is one call of ember-core's
//! fused multi-tensor step (`ember_core::fused::{adam_, sgd_}`: a few kernel launches on
//! CUDA, one rayon loop on the CPU); a parameter whose tensors the fused step does not take
//! (not contiguous, a gradient of another dtype, storages shared within the group) goes through
//! the per-tensor path of composed tensor ops instead. Both follow PyTorch's
//! `_single_tensor_*` functions op for op, and give the same bits in f32 and f64, so f64
//! results agree with PyTorch to rounding (~1e-15 relative per step).
//!
//! Note [State dict format]: [`Optimizer::state_dict`] returns a flat list of named tensors,
//! the names following the nesting of PyTorch's `optimizer.state_dict()`:
//! - `state.{i}.{name}` for parameter `i` (its position in the list given to `new`, PyTorch's
//!   index): `step` (Adam/AdamW; a 0-d f32 tensor on the CPU, as PyTorch's default),
//!   `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` (with `amsgrad`), `momentum_buffer` (SGD with
//!   `momentum != 0`). A parameter that never had a gradient has no entries.
//! - `param_groups.0.lr` (0-d f64), and `param_groups.0.initial_lr` (0-d f64) once an LR
//!   scheduler has recorded it. The other hyperparameters stay with the optimizer's config.
//!
//! The state tensors are returned as shared handles, as PyTorch's `state_dict()` does (except
//! an Adam `step` kept on the device, which is returned as a CPU copy);
//! [`Optimizer::load_state_dict`] copies what it loads (casting to each parameter's dtype and
//! device, except `step`, which may come from any device) and replaces the whole state, so
//! later steps never write into the caller's tensors.
//!
//! Note [Learning rate on the device]: [`SGD`], [`Adam`] and [`AdamW`] keep their learning rate
//! on the host (`lr()`, the state dict) and, for parameters on a GPU, also in a 0-d f64 tensor
//! on that GPU (`DeviceLr`) that the fused steps read there (`lr` of
//! `ember_core::fused::{adam_scaled_, sgd_scaled_}`). [`Optimizer::set_lr`] (what LR schedulers
//! call) writes the new value into that tensor on the current stream, so a step recorded into a
//! CUDA graph uses the lr of the moment it is replayed, and an eager step uses the same bits as
//! before (Note [Capturable optimizer steps] in ember-core's `cuda_backend/optim.rs`). Adam's step
//! counts live on the parameter's device for the same reason (see `adam.rs`). CPU parameters
//! read the host value, as before.
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
pub mod sgd;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::{clip_grad_norm_, clip_grad_value_};
pub use lr_scheduler::{
    ChainedScheduler, CosineAnnealingLR, EpochScheduler, LRScheduler, LinearLR, SequentialLR, StepLR,
};
pub use sgd::{SgdConfig, SGD};

use ember_core::{DType, Device, Error, Result, Tensor};

/// An optimizer over one group of parameters (`torch.optim.Optimizer`).
pub trait Optimizer {
    /// Performs one update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// The parameters, in the order given to `new` (PyTorch's `param_groups[0]["params"]`).
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

    /// The current learning rate.
    fn lr(&self) -> f64;

    /// Sets the learning rate used by the next steps (LR schedulers call this).
    fn set_lr(&mut self, lr: f64);

    /// The `initial_lr` of PyTorch's param group: the lr recorded by the first LR scheduler
    /// built on this optimizer, `None` before.
    fn initial_lr(&self) -> Option<f64>;

    /// Records `initial_lr` (LR schedulers call this; see [`Optimizer::initial_lr`]).
    fn set_initial_lr(&mut self, lr: f64);

    /// The optimizer state as named tensors; see Note [State dict format] in this module.
    fn state_dict(&self) -> Vec<(String, Tensor)>;

    /// Replaces the state with `state` (the format of [`Optimizer::state_dict`]), copying it.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()>;
}

/// The learning rate of an optimizer's param group in device memory: one 0-d f64 tensor per GPU
/// the group's parameters are on, made on first use (Note [Learning rate on the device]).
#[derive(Default)]
pub(crate) struct DeviceLr {
    tensors: Vec<Tensor>,
}

impl DeviceLr {
    /// The tensor holding `lr` on `device`, made now if missing; `None` for the CPU, whose steps
    /// read the host value.
    pub(crate) fn on(&mut self, device: Device, lr: f64) -> Result<Option<Tensor>> {
        if device == Device::Cpu {
            return Ok(None);
        }
        if let Some(t) = self.tensors.iter().find(|t| t.device() == device) {
            return Ok(Some(t.clone()));
        }
        let t = Tensor::scalar(lr, DType::F64, device)?;
        self.tensors.push(t.clone());
        Ok(Some(t))
    }

    /// The tensors for the devices of `params` (made where missing), for one step.
    pub(crate) fn for_params(&mut self, params: &[Tensor], lr: f64) -> Result<Vec<Tensor>> {
        let mut out: Vec<Tensor> = Vec::new();
        for p in params {
            if out.iter().all(|t| t.device() != p.device()) {
                out.extend(self.on(p.device(), lr)?);
            }
        }
        Ok(out)
    }

    /// Writes `lr` into every tensor, each on its device's current stream (a device-side
    /// update, ordered before the steps and graph replays enqueued after it). A tensor that
    /// cannot be written is dropped, so the next step makes a new one holding `lr`.
    pub(crate) fn set(&mut self, lr: f64) {
        let _g = ember_core::no_grad();
        self.tensors.retain(|t| t.fill_(lr).is_ok());
    }
}

/// The tensor of `lrs` on `device`, if any.
pub(crate) fn lr_on(lrs: &[Tensor], device: Device) -> Option<&Tensor> {
    lrs.iter().find(|t| t.device() == device)
}

/// The learning rate and `initial_lr` of an optimizer's one param group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupLr {
    pub(crate) lr: f64,
    pub(crate) initial_lr: Option<f64>,
}

impl GroupLr {
    /// Appends `param_groups.0.lr` (and `initial_lr` when set) to `out`.
    pub(crate) fn push_state(&self, out: &mut Vec<(String, Tensor)>) {
        let mut push = |name: &str, v: f64| {
            if let Ok(t) = Tensor::scalar(v, DType::F64, Device::Cpu) {
                out.push((format!("param_groups.0.{name}"), t));
            }
        };
        push("lr", self.lr);
        if let Some(v) = self.initial_lr {
            push("initial_lr", v);
        }
    }
}

/// One parsed key of a state dict.
pub(crate) enum StateKey<'a> {
    /// `state.{index}.{name}`.
    Param { index: usize, name: &'a str },
    /// `param_groups.0.{name}`.
    Group { name: &'a str },
}

/// Parses `key` (see Note [State dict format]); `num_params` bounds the parameter index.
pub(crate) fn parse_state_key<'a>(op: &'static str, key: &'a str, num_params: usize) -> Result<StateKey<'a>> {
    let bad = || {
        Error::invalid(
            op,
            format!("unexpected key {key:?} in state dict: expected \"state.<param index>.<name>\" or \"param_groups.0.<name>\""),
        )
    };
    if let Some(rest) = key.strip_prefix("state.") {
        let (index, name) = rest.split_once('.').ok_or_else(bad)?;
        let index: usize = index.parse().map_err(|_| bad())?;
        if index >= num_params {
            return Err(Error::invalid(
                op,
                format!("state dict key {key:?} names parameter {index}, but the optimizer has {num_params} parameters"),
            ));
        }
        return Ok(StateKey::Param { index, name });
    }
    if let Some(name) = key.strip_prefix("param_groups.0.") {
        return Ok(StateKey::Group { name });
    }
    Err(bad())
}

/// Loads a `param_groups.0.{name}` entry into `group`.
pub(crate) fn load_group_entry(
    op: &'static str,
    group: &mut GroupLr,
    name: &str,
    value: &Tensor,
) -> Result<()> {
    let v = value.item_f64()?;
    match name {
        "lr" => group.lr = v,
        "initial_lr" => group.initial_lr = Some(v),
        _ => {
            return Err(Error::invalid(
                op,
                format!(
                    "unexpected param group entry {name:?} in state dict: expected \"lr\" or \"initial_lr\""
                ),
            ))
        }
    }
    Ok(())
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
/// whole group passes `ember_core::fused::can_fuse` (no shared storages).
pub(crate) fn fused_groups<'a>(n: usize, tensors_of: impl Fn(usize) -> Vec<&'a Tensor>) -> FusedGroups {
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
        let all: Vec<&Tensor> = group.iter().flat_map(|&i| tensors_of(i)).collect();
        if ember_core::fused::can_fuse(&all) {
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
