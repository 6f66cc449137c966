//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`), with `amsgrad` and `maximize`.
//!
//! The update of one parameter, as PyTorch's `_single_tensor_adam` (op for op):
//! ```text
//! g = maximize ? -grad : grad
//! step += 1
//! if weight_decay != 0:
//!     AdamW (decoupled): p *= 1 - lr * weight_decay       (in place)
//!     Adam (L2):         g = g + weight_decay * p
//! exp_avg.lerp_(g, 1 - beta1)
//! exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g   (in place)
//! bias_correction1 = 1 - beta1^step;  bias_correction2 = 1 - beta2^step    (host f64)
//! v = amsgrad ? (max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq)) : exp_avg_sq
//! denom = sqrt(v) / sqrt(bias_correction2) + eps
//! p += -(lr / bias_correction1) * exp_avg / denom        (in place)
//! ```
//! `step` is a 0-d f32 tensor on the parameter's device (PyTorch's fused and capturable Adam):
//! the fused step advances it and computes the bias corrections from it on the device, without
//! the host, and the lr comes from a device tensor too (Note [Learning rate on the device] in
//! `optim`), so nothing of a CUDA step is passed by value that changes between steps and the
//! step can be recorded into a CUDA graph. On CUDA the bias corrections then use the device's
//! `pow`, which may differ from the host's in the last bit of the f64 (PyTorch's fused Adam
//! does the same). A parameter the fused step does not take (Note [Foreach step functions])
//! reads its count back to the host, one wait per step.

use super::param_group::{split_state, Group, GroupConfig, Groups, Hyper, ParamGroup};
use super::{
    check_non_negative, check_params, check_state_index, load_like_param, lr_on, zero_grads, Optimizer,
};
use crate::state_dict::StateDictResult;
use ember_core::fused::{self, AdamStep, AdamSteps, GradScaling};
use ember_core::{DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// Hyperparameters of [`Adam`] and [`AdamW`]. `Default` is Adam's PyTorch default
/// (`lr = 1e-3`, `betas = (0.9, 0.999)`, `eps = 1e-8`, no weight decay);
/// [`AdamConfig::adamw`] is AdamW's (the same with `weight_decay = 1e-2`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment averages, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// L2 penalty for Adam (added to the gradient); decoupled decay rate for AdamW.
    pub weight_decay: f64,
    /// Use the maximum of past second moments (AMSGrad).
    pub amsgrad: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
    /// The fused step (`fused=`): `None` (PyTorch's default) fuses every parameter it can and
    /// takes the per-tensor path for the rest, saying so once on stderr; `Some(true)` requires
    /// the fused step for every parameter (a typed error at `step` naming the first that cannot
    /// take it, before anything changes); `Some(false)` takes the per-tensor path for all
    /// (PyTorch's `foreach=False`). Note [Fused or per-tensor].
    pub fused: Option<bool>,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
            fused: None,
        }
    }
}

impl GroupConfig for AdamConfig {
    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn hyperparameters(&self) -> Vec<(&'static str, Hyper)> {
        vec![
            ("lr", Hyper::F64(self.lr)),
            ("betas", Hyper::Pair(self.betas.0, self.betas.1)),
            ("eps", Hyper::F64(self.eps)),
            ("weight_decay", Hyper::F64(self.weight_decay)),
            ("amsgrad", Hyper::Bool(self.amsgrad)),
            ("maximize", Hyper::Bool(self.maximize)),
            ("fused", Hyper::OptBool(self.fused)),
        ]
    }

    fn set_hyperparameter(&mut self, name: &str, value: Hyper) {
        match (name, value) {
            ("lr", Hyper::F64(v)) => self.lr = v,
            ("betas", Hyper::Pair(a, b)) => self.betas = (a, b),
            ("eps", Hyper::F64(v)) => self.eps = v,
            ("weight_decay", Hyper::F64(v)) => self.weight_decay = v,
            ("amsgrad", Hyper::Bool(v)) => self.amsgrad = v,
            ("maximize", Hyper::Bool(v)) => self.maximize = v,
            ("fused", Hyper::OptBool(v)) => self.fused = v,
            _ => debug_assert!(false, "{name} = {value:?} is not an Adam hyperparameter"),
        }
    }

    fn check(&self, op: &'static str) -> Result<()> {
        self.validate(op)
    }
}

impl AdamConfig {
    /// PyTorch's defaults for `torch.optim.AdamW` (`weight_decay = 1e-2`).
    pub fn adamw() -> Self {
        AdamConfig {
            weight_decay: 1e-2,
            ..AdamConfig::default()
        }
    }

    /// These defaults with the overrides of `group` (Note [Param groups]), checked.
    fn for_group(&self, group: &ParamGroup, op: &'static str) -> Result<AdamConfig> {
        group.refuse(
            op,
            &[
                ("momentum", group.momentum.is_some()),
                ("dampening", group.dampening.is_some()),
                ("nesterov", group.nesterov.is_some()),
            ],
        )?;
        let config = AdamConfig {
            lr: group.lr.unwrap_or(self.lr),
            betas: group.betas.unwrap_or(self.betas),
            eps: group.eps.unwrap_or(self.eps),
            weight_decay: group.weight_decay.unwrap_or(self.weight_decay),
            ..*self
        };
        config.validate(op)?;
        Ok(config)
    }

    /// Checks the hyperparameters as `torch.optim.Adam.__init__` does.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_non_negative(op, "learning rate", self.lr)?;
        check_non_negative(op, "epsilon value", self.eps)?;
        for (i, beta) in [self.betas.0, self.betas.1].into_iter().enumerate() {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(
                    op,
                    format!("Invalid beta parameter at index {i}: {beta}"),
                ));
            }
        }
        check_non_negative(op, "weight_decay value", self.weight_decay)
    }
}

/// The state tensors of the parameters being updated, one entry per parameter (PyTorch's
/// `exp_avgs`, `exp_avg_sqs`, `max_exp_avg_sqs`, `state_steps` lists).
pub struct AdamStateSlices<'a> {
    /// First moment averages.
    pub exp_avgs: &'a [Tensor],
    /// Second moment averages.
    pub exp_avg_sqs: &'a [Tensor],
    /// Running maxima of the second moments (empty unless `amsgrad`).
    pub max_exp_avg_sqs: &'a [Tensor],
    /// Step counts, 0-d f32 tensors.
    pub state_steps: &'a [Tensor],
}

/// One Adam (or, with `decoupled_weight_decay`, AdamW) update of every `params[i]` from
/// `grads[i]` (PyTorch's functional `adam`); see the module docs for the formula and Note
/// [Foreach step functions] in `optim`. Increments each step count.
pub fn adam(
    params: &[Tensor],
    grads: &[Tensor],
    state: AdamStateSlices<'_>,
    config: &AdamConfig,
    decoupled_weight_decay: bool,
) -> Result<()> {
    adam_scaled(
        params,
        grads,
        state,
        config,
        decoupled_weight_decay,
        GradScaling::default(),
    )
}

/// [`adam`] under a GradScaler (see Note [Steps under a GradScaler] in `optim`): the gradients
/// are divided by `scaling.grad_scale` (and written back unscaled), and when
/// `scaling.found_inf` is nonzero nothing changes, step counts included.
///
/// Where a step count lives decides who counts: one on its parameter's device (always so for
/// CPU parameters; on CUDA once [`Adam`] has moved it there for a scaled step) is advanced by
/// the fused step itself, which also reads it for the bias corrections, so the host never waits
/// for it; one on the CPU for a CUDA parameter (PyTorch's default) is advanced and read on the
/// host. The skip is decided on the device except for host-kept counts and parameters on the
/// per-tensor path, for which the flag is read on the host, once.
pub fn adam_scaled(
    params: &[Tensor],
    grads: &[Tensor],
    state: AdamStateSlices<'_>,
    config: &AdamConfig,
    decoupled_weight_decay: bool,
    scaling: GradScaling<'_>,
) -> Result<()> {
    adam_with_lr(params, grads, state, config, decoupled_weight_decay, scaling, &[])
}

/// [`adam_scaled`] whose fused steps read the lr from the tensor of `lrs` on their device, where
/// there is one (Note [Learning rate on the device] in `optim`); it holds `config.lr`.
pub(crate) fn adam_with_lr(
    params: &[Tensor],
    grads: &[Tensor],
    state: AdamStateSlices<'_>,
    config: &AdamConfig,
    decoupled_weight_decay: bool,
    scaling: GradScaling<'_>,
    lrs: &[Tensor],
) -> Result<()> {
    let n = params.len();
    let amsgrad_len = if config.amsgrad {
        state.max_exp_avg_sqs.len()
    } else {
        n
    };
    let lens = [
        grads.len(),
        state.exp_avgs.len(),
        state.exp_avg_sqs.len(),
        amsgrad_len,
        state.state_steps.len(),
    ];
    if lens.iter().any(|&l| l != n) {
        return Err(Error::invalid(
            "adam",
            format!(
                "expected {n} gradients and state tensors of each kind (one per parameter), got {lens:?}"
            ),
        ));
    }
    let _g = ember_core::no_grad();
    let max_of = |i: usize| config.amsgrad.then(|| &state.max_exp_avg_sqs[i]);
    // Note [Foreach step functions]: one fused call per device and dtype, and per place of the
    // step counts.
    let mut groups = super::fused_groups(n, scaling.grad_scale.is_none(), |i| {
        let mut ts = vec![&params[i], &grads[i], &state.exp_avgs[i], &state.exp_avg_sqs[i]];
        ts.extend(max_of(i));
        ts
    });
    choose_path(&mut groups, config.fused, params, grads)?;
    let step_t = |i: usize| &state.state_steps[i];
    let device_counted = |i: usize| {
        let s = step_t(i);
        s.device() == params[i].device() && s.dtype() == DType::F32 && s.numel() == 1
    };
    let mut host_counted: Vec<usize> = groups
        .fused
        .iter()
        .flatten()
        .copied()
        .filter(|&i| !device_counted(i))
        .chain(groups.single.iter().copied())
        .collect();
    host_counted.sort_unstable();
    // What the device cannot skip by itself is skipped (or not) here.
    if !host_counted.is_empty() && super::found_inf_on_host(scaling.found_inf)? {
        host_counted.clear();
    }
    let mut steps = vec![0.0; n];
    for &i in &host_counted {
        step_t(i).add_scalar_(1.0)?;
        steps[i] = step_t(i).item_f64()?;
    }
    let host_steps_on = |i: usize| host_counted.binary_search(&i).is_ok();
    let step = AdamStep {
        lr: config.lr,
        beta1: config.betas.0,
        beta2: config.betas.1,
        eps: config.eps,
        weight_decay: config.weight_decay,
        amsgrad: config.amsgrad,
        maximize: config.maximize,
        decoupled_weight_decay,
    };
    for group in groups.fused {
        let device = params[group[0]].device();
        let on = super::ScalingOn::new(&scaling, device)?;
        let lr = lr_on(lrs, device);
        let (on_device, on_host): (Vec<usize>, Vec<usize>) = group.iter().partition(|&&i| device_counted(i));
        let on_host: Vec<usize> = on_host.into_iter().filter(|&i| host_steps_on(i)).collect();
        for (part, device_steps) in [(on_device, true), (on_host, false)] {
            if part.is_empty() {
                continue;
            }
            let pick = |list: &[Tensor]| -> Vec<Tensor> { part.iter().map(|&i| list[i].clone()).collect() };
            let maxes: Vec<Tensor> = part.iter().filter_map(|&i| max_of(i).cloned()).collect();
            let step_tensors = pick(state.state_steps);
            let host_steps: Vec<f64> = part.iter().map(|&i| steps[i]).collect();
            let (counts, scaling) = if device_steps {
                (AdamSteps::Device(&step_tensors), on.get())
            } else {
                // Not skipped (decided above); the gradients may still carry the scale.
                let s = GradScaling {
                    found_inf: None,
                    ..on.get()
                };
                (AdamSteps::Host(&host_steps), s)
            };
            fused::adam_scaled_(
                &pick(params),
                &pick(grads),
                &pick(state.exp_avgs),
                &pick(state.exp_avg_sqs),
                config.amsgrad.then_some(&maxes[..]),
                counts,
                &step,
                scaling,
                lr,
            )?;
        }
    }
    for i in groups.single {
        if !host_steps_on(i) {
            continue;
        }
        super::unscale_grad(&grads[i], scaling.grad_scale)?;
        adam_single(
            &params[i],
            &grads[i],
            [&state.exp_avgs[i], &state.exp_avg_sqs[i]],
            max_of(i),
            steps[i],
            config,
            decoupled_weight_decay,
        )?;
    }
    Ok(())
}

/// Set once the per-tensor fallback has been reported (Note [Fused or per-tensor]).
static FALLBACK_REPORTED: AtomicBool = AtomicBool::new(false);

/// Note [Fused or per-tensor]: PyTorch's `fused=True` raises when a parameter cannot take the
/// fused kernel, and its default silently uses the slower path. Here `fused: Some(true)`
/// answers the same typed error (before any parameter changes), `Some(false)` forces the
/// per-tensor path, and the default takes the fused step where it can and prints one line on
/// stderr the first time any parameter of the process falls back, naming it and the reason
/// class (a device, dtype or layout the fused step does not take), since the per-tensor path
/// costs about 10 kernels per parameter instead of one per group.
fn choose_path(
    groups: &mut super::FusedGroups,
    fused: Option<bool>,
    params: &[Tensor],
    grads: &[Tensor],
) -> Result<()> {
    let describe = |i: usize| {
        let (p, g) = (&params[i], &grads[i]);
        format!(
            "parameter {i} ({} {:?} on {}, contiguous {}; gradient {:?} on {}, contiguous {})",
            p.shape(),
            p.dtype(),
            p.device(),
            p.is_contiguous(),
            g.dtype(),
            g.device(),
            g.is_contiguous()
        )
    };
    match fused {
        Some(true) => {
            if let Some(&i) = groups.single.first() {
                return Err(Error::invalid(
                    "adam",
                    format!(
                        "fused=True requires every parameter, its gradient and state to be contiguous floating-point tensors of one device and dtype that the fused step takes; {} is not; make it contiguous or leave fused unset",
                        describe(i)
                    ),
                ));
            }
        }
        Some(false) => {
            groups.single.extend(groups.fused.drain(..).flatten());
            groups.single.sort_unstable();
        }
        None => {
            if let Some(&i) = groups.single.first() {
                if !FALLBACK_REPORTED.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "ember: Adam/AdamW takes the slower per-tensor step for {} of {} parameters, first {}; set fused: Some(true) to make this an error or Some(false) to silence it",
                        groups.single.len(),
                        params.len(),
                        describe(i)
                    );
                }
            }
        }
    }
    Ok(())
}

/// The per-tensor Adam step of one parameter (its step count already incremented to `step`),
/// for tensors the fused step does not take (see Note [Fused step preconditions] in
/// `ember_core::fused`); the same arithmetic, as composed tensor ops.
fn adam_single(
    param: &Tensor,
    grad: &Tensor,
    [exp_avg, exp_avg_sq]: [&Tensor; 2],
    max_exp_avg_sq: Option<&Tensor>,
    step: f64,
    config: &AdamConfig,
    decoupled_weight_decay: bool,
) -> Result<()> {
    let (beta1, beta2) = config.betas;
    let grad = if config.maximize {
        grad.neg()?
    } else {
        grad.clone()
    };
    let grad = if config.weight_decay == 0.0 {
        grad
    } else if decoupled_weight_decay {
        param.mul_scalar_(1.0 - config.lr * config.weight_decay)?;
        grad
    } else {
        grad.add(&param.mul_scalar(config.weight_decay)?)?
    };
    exp_avg.lerp_(&grad, 1.0 - beta1)?;
    exp_avg_sq
        .mul_scalar_(beta2)?
        .addcmul_(&grad, &grad, 1.0 - beta2)?;
    let bias_correction1 = 1.0 - beta1.powf(step);
    let bias_correction2 = 1.0 - beta2.powf(step);
    let step_size = config.lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.sqrt();
    let second = match max_exp_avg_sq {
        Some(m) => m.maximum_(exp_avg_sq)?,
        None => exp_avg_sq.clone(),
    };
    let denom = second
        .sqrt()?
        .div_scalar(bias_correction2_sqrt)?
        .add_scalar(config.eps)?;
    param.addcdiv_(exp_avg, &denom, -step_size)?;
    Ok(())
}

/// The state of one parameter.
struct ParamState {
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Option<Tensor>,
}

impl ParamState {
    fn new(param: &Tensor, amsgrad: bool) -> Result<ParamState> {
        Ok(ParamState {
            step: Tensor::scalar(0.0, DType::F32, param.device())?,
            exp_avg: param.zeros_like()?,
            exp_avg_sq: param.zeros_like()?,
            max_exp_avg_sq: if amsgrad { Some(param.zeros_like()?) } else { None },
        })
    }
}

/// What Adam and AdamW share: param groups, defaults and state; `decoupled` picks AdamW.
struct AdamCore {
    groups: Groups<AdamConfig>,
    /// The config given to `new`/`with_groups`: what a group does not override.
    defaults: AdamConfig,
    /// One entry per parameter of all groups (the optimizer-wide numbering).
    state: Vec<Option<ParamState>>,
    decoupled: bool,
    name: &'static str,
}

impl AdamCore {
    fn new(params: Vec<Tensor>, config: AdamConfig, decoupled: bool, name: &'static str) -> Result<AdamCore> {
        config.validate(name)?;
        check_params(name, &params)?;
        AdamCore::with_groups(vec![ParamGroup::new(params)], config, decoupled, name)
    }

    fn with_groups(
        groups: Vec<ParamGroup>,
        defaults: AdamConfig,
        decoupled: bool,
        name: &'static str,
    ) -> Result<AdamCore> {
        defaults.validate(name)?;
        let groups = groups
            .into_iter()
            .map(|g| {
                let config = defaults.for_group(&g, name)?;
                Ok((g.params, config))
            })
            .collect::<Result<Vec<_>>>()?;
        let groups = Groups::new(name, groups)?;
        let n = groups.params.len();
        Ok(AdamCore {
            groups,
            defaults,
            state: (0..n).map(|_| None).collect(),
            decoupled,
            name,
        })
    }

    fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        let config = self.defaults.for_group(&group, self.name)?;
        self.groups.push(self.name, group.params, config)?;
        self.state.resize_with(self.groups.params.len(), || None);
        Ok(())
    }

    fn config(&self) -> AdamConfig {
        self.groups.groups[0].config
    }

    /// One step of every parameter with a gradient, under `scaling`: one call of the foreach
    /// function per param group (Note [Param groups]). Step counts live on their parameter's
    /// device (one loaded from a state dict is moved there on its first step).
    fn step_with(&mut self, scaling: GradScaling<'_>) -> Result<()> {
        for group in &mut self.groups.groups {
            // The group's own: a loaded state dict may set it (Note [Param groups]).
            let amsgrad = group.config.amsgrad;
            let (mut params, mut grads) = (Vec::new(), Vec::new());
            let (mut exp_avgs, mut exp_avg_sqs, mut maxes, mut steps) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let slots = &mut self.state[group.indices()];
            for (p, slot) in group.params.iter().zip(slots.iter_mut()) {
                let Some(g) = p.grad() else { continue };
                if slot.is_none() {
                    *slot = Some(ParamState::new(p, amsgrad)?);
                }
                let s = slot.as_mut().expect("initialized above");
                if amsgrad && s.max_exp_avg_sq.is_none() {
                    s.max_exp_avg_sq = Some(p.zeros_like()?);
                }
                if s.step.device() != p.device() {
                    // Once (a loaded count): a 4-byte copy that does not wait.
                    s.step = s.step.to(p.device())?;
                }
                params.push(p.clone());
                grads.push(g);
                exp_avgs.push(s.exp_avg.clone());
                exp_avg_sqs.push(s.exp_avg_sq.clone());
                steps.push(s.step.clone());
                if let (true, Some(m)) = (amsgrad, &s.max_exp_avg_sq) {
                    maxes.push(m.clone());
                }
            }
            if params.is_empty() {
                continue;
            }
            let state = AdamStateSlices {
                exp_avgs: &exp_avgs,
                exp_avg_sqs: &exp_avg_sqs,
                max_exp_avg_sqs: &maxes,
                state_steps: &steps,
            };
            let lrs = group.device_lr.for_params(&params, group.config.lr)?;
            adam_with_lr(
                &params,
                &grads,
                state,
                &group.config,
                self.decoupled,
                scaling,
                &lrs,
            )?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, s) in self.state.iter().enumerate() {
            let Some(s) = s else { continue };
            // Note [State dict format]: the count as a CPU tensor, wherever it is kept.
            let step = s.step.to(Device::Cpu).unwrap_or_else(|_| s.step.clone());
            out.push((format!("state.{i}.step"), step));
            out.push((format!("state.{i}.exp_avg"), s.exp_avg.clone()));
            out.push((format!("state.{i}.exp_avg_sq"), s.exp_avg_sq.clone()));
            if let Some(m) = &s.max_exp_avg_sq {
                out.push((format!("state.{i}.max_exp_avg_sq"), m.clone()));
            }
        }
        self.groups.push_state(&mut out);
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()> {
        let op = if self.decoupled {
            "AdamW.load_state_dict"
        } else {
            "Adam.load_state_dict"
        };
        let (entries, group_entries) = split_state(op, state)?;
        let groups = self.groups.load_entries(op, &group_entries)?;
        let n = self.groups.params.len();
        // step, exp_avg, exp_avg_sq, max_exp_avg_sq of each parameter, as loaded.
        let mut loaded: Vec<[Option<Tensor>; 4]> = (0..n).map(|_| Default::default()).collect();
        for (index, name, value) in entries {
            check_state_index(op, index, name, n)?;
            let param = &self.groups.params[index];
            let (slot, t) = match name {
                "step" => {
                    if value.numel() != 1 {
                        return Err(Error::invalid(
                            op,
                            format!("\"state.{index}.step\" must hold one value, it has {}", value.numel()),
                        )
                        .into());
                    }
                    let _g = ember_core::no_grad();
                    let step = value.to_dtype(DType::F32)?.to(Device::Cpu)?.reshape(())?;
                    (0, step.deep_clone()?)
                }
                "exp_avg" => (1, load_like_param(op, value, param)?),
                "exp_avg_sq" => (2, load_like_param(op, value, param)?),
                "max_exp_avg_sq" => (3, load_like_param(op, value, param)?),
                _ => {
                    return Err(Error::invalid(
                        op,
                        format!("unexpected state {name:?} in \"state.{index}.{name}\": expected step, exp_avg, exp_avg_sq or max_exp_avg_sq"),
                    )
                    .into())
                }
            };
            loaded[index][slot] = Some(t);
        }
        let mut states = Vec::with_capacity(n);
        for (i, [step, exp_avg, exp_avg_sq, max]) in loaded.into_iter().enumerate() {
            let amsgrad = groups[self.groups.group_of(i)].0.amsgrad;
            let any = step.is_some() || exp_avg.is_some() || exp_avg_sq.is_some() || max.is_some();
            let state = match (step, exp_avg, exp_avg_sq) {
                (Some(step), Some(exp_avg), Some(exp_avg_sq)) => {
                    if amsgrad && max.is_none() {
                        return Err(Error::invalid(
                            op,
                            format!("state of parameter {i} has no max_exp_avg_sq, which amsgrad needs"),
                        )
                        .into());
                    }
                    Some(ParamState {
                        step,
                        exp_avg,
                        exp_avg_sq,
                        max_exp_avg_sq: max,
                    })
                }
                _ if any => {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "state of parameter {i} is incomplete: it needs step, exp_avg and exp_avg_sq"
                        ),
                    )
                    .into())
                }
                _ => None,
            };
            states.push(state);
        }
        self.state = states;
        self.groups.apply_loaded(groups);
        Ok(())
    }
}

macro_rules! adam_optimizer {
    ($name:ident, $decoupled:expr, $doc:literal) => {
        #[doc = $doc]
        pub struct $name(AdamCore);

        impl $name {
            #[doc = concat!("A ", stringify!($name), " optimizer over `params` (leaf tensors, usually with `requires_grad`), one param group.")]
            pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<$name> {
                AdamCore::new(params, config, $decoupled, stringify!($name)).map($name)
            }

            #[doc = concat!("A ", stringify!($name), " optimizer over param groups (PyTorch's `", stringify!($name), "([{\"params\": ..., \"weight_decay\": 0.0}, ...], lr=...)`): each group's hyperparameters are `defaults` with the group's overrides (Note [Param groups]). Groups may set `lr`, `weight_decay`, `betas` and `eps`.")]
            pub fn with_groups(groups: Vec<ParamGroup>, defaults: AdamConfig) -> Result<$name> {
                AdamCore::with_groups(groups, defaults, $decoupled, stringify!($name)).map($name)
            }

            /// Appends a param group (`add_param_group`): its parameters are numbered after all
            /// those already held; the defaults fill what it does not set.
            pub fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
                self.0.add_param_group(group)
            }

            /// The param groups (`optimizer.param_groups`), each with its complete config.
            pub fn param_groups(&self) -> &[Group<AdamConfig>] {
                &self.0.groups.groups
            }

            /// The hyperparameters of group 0 (`lr` as currently set); see
            #[doc = concat!("[`", stringify!($name), "::param_groups`] for the others.")]
            pub fn config(&self) -> AdamConfig {
                self.0.config()
            }

            /// The config given to `new` or `with_groups` (`optimizer.defaults`): what a
            /// group does not override.
            pub fn defaults(&self) -> AdamConfig {
                self.0.defaults
            }

            /// The parameters of all groups, in order (the state dict's numbering).
            pub fn params(&self) -> &[Tensor] {
                &self.0.groups.params
            }
        }

        impl Optimizer for $name {
            fn step(&mut self) -> Result<()> {
                self.0.step_with(GradScaling::default())
            }

            fn params(&self) -> &[Tensor] {
                &self.0.groups.params
            }

            fn supports_amp_scaling(&self) -> bool {
                true
            }

            fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> Result<()> {
                self.0.step_with(GradScaling {
                    grad_scale,
                    found_inf: Some(found_inf),
                })
            }

            fn zero_grad(&mut self) -> Result<()> {
                zero_grads(&self.0.groups.params)
            }

            fn lr(&self) -> f64 {
                self.0.groups.lr(0)
            }

            fn set_lr(&mut self, lr: f64) {
                self.0.groups.set_all_lr(lr);
            }

            fn initial_lr(&self) -> Option<f64> {
                self.0.groups.initial_lr(0)
            }

            fn set_initial_lr(&mut self, lr: f64) {
                for g in 0..self.0.groups.groups.len() {
                    self.0.groups.set_initial_lr(g, lr);
                }
            }

            fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
                self.0.add_param_group(group)
            }

            fn num_param_groups(&self) -> usize {
                self.0.groups.groups.len()
            }

            fn group_lr(&self, group: usize) -> f64 {
                self.0.groups.lr(group)
            }

            fn set_group_lr(&mut self, group: usize, lr: f64) {
                self.0.groups.set_lr(group, lr);
            }

            fn group_initial_lr(&self, group: usize) -> Option<f64> {
                self.0.groups.initial_lr(group)
            }

            fn set_group_initial_lr(&mut self, group: usize, lr: f64) {
                self.0.groups.set_initial_lr(group, lr);
            }

            fn param_group_state(&self, group: usize) -> Vec<(String, Tensor)> {
                self.0.groups.group_state(group)
            }

            fn state_dict(&self) -> Vec<(String, Tensor)> {
                self.0.state_dict()
            }

            fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()> {
                self.0.load_state_dict(state)
            }
        }
    };
}

adam_optimizer!(
    Adam,
    false,
    "Adam (`torch.optim.Adam`): weight decay as an L2 penalty added to the gradient."
);
adam_optimizer!(
    AdamW,
    true,
    "AdamW (`torch.optim.AdamW`): decoupled weight decay `p *= 1 - lr * weight_decay`; build its config from [`AdamConfig::adamw`] for PyTorch's default decay of 1e-2."
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testing::{param, set_grad};

    fn assert_close(got: &[f64], expected: &[f64], tol: f64) {
        assert_eq!(got.len(), expected.len());
        for (g, e) in got.iter().zip(expected) {
            assert!(
                (g - e).abs() <= tol * (1.0 + e.abs()),
                "got {got:?}, expected {expected:?}"
            );
        }
    }

    /// Plain-f64 Adam/AdamW, written from the formula: `p0` updated by each of `grads`.
    fn reference(cfg: &AdamConfig, decoupled: bool, p0: &[f64], grads: &[Vec<f64>]) -> Vec<f64> {
        let (b1, b2) = cfg.betas;
        let mut p = p0.to_vec();
        let (mut m, mut v, mut vmax) = (vec![0.0; p.len()], vec![0.0; p.len()], vec![0.0f64; p.len()]);
        for (t, g) in grads.iter().enumerate() {
            let t = (t + 1) as f64;
            for j in 0..p.len() {
                let mut g = if cfg.maximize { -g[j] } else { g[j] };
                if decoupled {
                    p[j] *= 1.0 - cfg.lr * cfg.weight_decay;
                } else {
                    g += cfg.weight_decay * p[j];
                }
                m[j] = b1 * m[j] + (1.0 - b1) * g;
                v[j] = b2 * v[j] + (1.0 - b2) * g * g;
                vmax[j] = vmax[j].max(v[j]);
                let v_used = if cfg.amsgrad { vmax[j] } else { v[j] };
                let m_hat = m[j] / (1.0 - b1.powf(t));
                let denom = v_used.sqrt() / (1.0 - b2.powf(t)).sqrt() + cfg.eps;
                p[j] -= cfg.lr * m_hat / denom;
            }
        }
        p
    }

    /// Runs `Adam` (or `AdamW`) on one parameter; returns its values after all the steps.
    fn run(cfg: AdamConfig, decoupled: bool, p0: &[f64], grads: &[Vec<f64>]) -> Vec<f64> {
        let p = param(p0);
        let mut opt: Box<dyn Optimizer> = if decoupled {
            Box::new(AdamW::new(vec![p.clone()], cfg).unwrap())
        } else {
            Box::new(Adam::new(vec![p.clone()], cfg).unwrap())
        };
        for g in grads {
            set_grad(&p, g);
            opt.step().unwrap();
        }
        p.to_vec_f64().unwrap()
    }

    fn cfg(lr: f64) -> AdamConfig {
        AdamConfig {
            lr,
            ..Default::default()
        }
    }

    #[test]
    fn defaults_match_pytorch() {
        let d = AdamConfig::default();
        assert_eq!(
            (d.lr, d.betas, d.eps, d.weight_decay),
            (1e-3, (0.9, 0.999), 1e-8, 0.0)
        );
        assert!(!d.amsgrad && !d.maximize);
        assert_eq!(AdamConfig::adamw().weight_decay, 1e-2);
    }

    #[test]
    fn first_step_by_hand() {
        // Step 1: m = 0.1 g, v = 0.001 g², m̂ = m / 0.1 = g, √v / √0.001 = |g|,
        // so p -= lr * g / (|g| + eps): [1 - 0.01 * 0.5 / (0.5 + 1e-8), 2 + 0.01 * 2 / (2 + 1e-8)].
        let got = run(cfg(0.01), false, &[1.0, 2.0], &[vec![0.5, -2.0]]);
        assert_close(
            &got,
            &[1.0 - 0.005 / (0.5 + 1e-8), 2.0 + 0.02 / (2.0 + 1e-8)],
            1e-12,
        );
    }

    #[test]
    fn l2_weight_decay_first_step_by_hand() {
        // g = [0.5, -2] + 0.1 * [1, 2] = [0.6, -1.8]; p -= lr * g / (|g| + eps).
        let c = AdamConfig {
            weight_decay: 0.1,
            ..cfg(0.01)
        };
        let got = run(c, false, &[1.0, 2.0], &[vec![0.5, -2.0]]);
        assert_close(
            &got,
            &[1.0 - 0.006 / (0.6 + 1e-8), 2.0 + 0.018 / (1.8 + 1e-8)],
            1e-12,
        );
    }

    #[test]
    fn adamw_first_step_by_hand() {
        // p *= 1 - 0.01 * 0.01 = 0.9999 -> [0.9999, 1.9998]; then p -= lr * g / (|g| + eps).
        let c = AdamConfig {
            lr: 0.01,
            ..AdamConfig::adamw()
        };
        let got = run(c, true, &[1.0, 2.0], &[vec![0.5, -2.0]]);
        assert_close(
            &got,
            &[0.9999 - 0.005 / (0.5 + 1e-8), 1.9998 + 0.02 / (2.0 + 1e-8)],
            1e-12,
        );
    }

    #[test]
    fn maximize_first_step_by_hand() {
        // g -> -g: p += lr * g / (|g| + eps).
        let c = AdamConfig {
            maximize: true,
            ..cfg(0.01)
        };
        let got = run(c, false, &[1.0], &[vec![0.5]]);
        assert_close(&got, &[1.0 + 0.005 / (0.5 + 1e-8)], 1e-12);
    }

    #[test]
    fn amsgrad_keeps_the_max_second_moment() {
        // Step 1, g = 2: v = 0.004, p = 1 - 0.1 * 2 / (2 + eps) ≈ 0.9.
        // Step 2, g = 0.01: v = 0.999 * 0.004 + 0.001 * 1e-4 = 0.0039961 < 0.004, so amsgrad
        // divides by √0.004 / √(1 - 0.999²) instead; m = 0.9 * 0.2 + 0.1 * 0.01 = 0.181.
        let c = AdamConfig {
            amsgrad: true,
            eps: 0.0,
            ..cfg(0.1)
        };
        let got = run(c, false, &[1.0], &[vec![2.0], vec![0.01]]);
        let m_hat = 0.181 / (1.0 - 0.81);
        let denom = 0.004f64.sqrt() / (1.0 - 0.999f64 * 0.999).sqrt();
        assert_close(&got, &[0.9 - 0.1 * m_hat / denom], 1e-12);
        let plain = run(
            AdamConfig { amsgrad: false, ..c },
            false,
            &[1.0],
            &[vec![2.0], vec![0.01]],
        );
        assert!((plain[0] - got[0]).abs() > 1e-6, "amsgrad changed nothing");
    }

    #[test]
    fn several_steps_match_reference() {
        let p0 = [0.5, -1.5, 2.0, 0.0];
        let grads: Vec<Vec<f64>> = (0..7)
            .map(|t| {
                (0..4)
                    .map(|j| ((t * 4 + j) as f64 * 0.7).sin() * (1.0 + j as f64))
                    .collect()
            })
            .collect();
        let configs = [
            cfg(0.01),
            AdamConfig {
                lr: 0.01,
                betas: (0.8, 0.99),
                eps: 1e-6,
                weight_decay: 0.05,
                amsgrad: true,
                maximize: false,
                fused: None,
            },
            AdamConfig {
                lr: 0.03,
                weight_decay: 0.1,
                maximize: true,
                ..Default::default()
            },
        ];
        for c in configs {
            for decoupled in [false, true] {
                let got = run(c, decoupled, &p0, &grads);
                let want = reference(&c, decoupled, &p0, &grads);
                assert_close(&got, &want, 1e-12);
            }
        }
    }

    #[test]
    fn f32_params_track_f64() {
        let p = Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let mut opt = Adam::new(vec![p.clone()], cfg(0.01)).unwrap();
        for g in [[0.5f32, -2.0], [0.1, 0.3]] {
            p.set_grad(Some(Tensor::from_slice(&g, [2], Device::Cpu).unwrap()))
                .unwrap();
            opt.step().unwrap();
        }
        assert_eq!(p.dtype(), DType::F32);
        let want = reference(&cfg(0.01), false, &[1.0, 2.0], &[vec![0.5, -2.0], vec![0.1, 0.3]]);
        assert_close(&p.to_vec_f64().unwrap(), &want, 1e-6);
    }

    #[test]
    fn skips_params_without_grad() {
        let (a, b) = (param(&[1.0]), param(&[2.0]));
        let mut opt = Adam::new(vec![a.clone(), b.clone()], cfg(0.1)).unwrap();
        set_grad(&b, &[1.0]);
        opt.step().unwrap();
        opt.step().unwrap();
        assert_eq!(a.to_vec_f64().unwrap(), [1.0]);
        let keys: Vec<String> = opt.state_dict().into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "state.1.step",
                "state.1.exp_avg",
                "state.1.exp_avg_sq",
                "param_groups.0.params",
                "param_groups.0.lr",
                "param_groups.0.betas",
                "param_groups.0.eps",
                "param_groups.0.weight_decay",
                "param_groups.0.amsgrad",
                "param_groups.0.maximize",
                "param_groups.0.fused"
            ]
        );
        // `a` gets a gradient later: its own step count starts at 1, `b`'s goes on to 3.
        set_grad(&a, &[1.0]);
        opt.step().unwrap();
        let state = opt.state_dict();
        let step = |k: &str| state.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(step("state.0.step").to_vec::<f32>().unwrap(), [1.0]);
        assert_eq!(step("state.1.step").to_vec::<f32>().unwrap(), [3.0]);
        assert_eq!(step("state.0.step").rank(), 0);
        assert_close(&a.to_vec_f64().unwrap(), &[0.9], 1e-9);
        opt.zero_grad().unwrap();
        assert!(a.grad().is_none() && b.grad().is_none());
    }

    #[test]
    fn state_dict_round_trip() {
        let c = AdamConfig {
            amsgrad: true,
            weight_decay: 0.1,
            ..cfg(0.01)
        };
        let (p, q) = (param(&[1.0, -1.0]), param(&[0.0, 0.0]));
        let mut a = AdamW::new(vec![p.clone()], c).unwrap();
        for g in [[1.0, 2.0], [-0.5, 0.25]] {
            set_grad(&p, &g);
            a.step().unwrap();
        }
        a.set_lr(0.02);
        a.set_initial_lr(0.01);
        {
            let _g = ember_core::no_grad();
            q.copy_(&p).unwrap();
        }
        let mut b = AdamW::new(vec![q.clone()], c).unwrap();
        b.load_state_dict(&a.state_dict()).unwrap();
        assert_eq!((b.lr(), b.initial_lr()), (0.02, Some(0.01)));
        for g in [[0.3, -0.7], [0.1, 0.1]] {
            set_grad(&p, &g);
            set_grad(&q, &g);
            a.step().unwrap();
            b.step().unwrap();
        }
        assert_eq!(p.to_vec_f64().unwrap(), q.to_vec_f64().unwrap());
        // The loaded state is a copy: a's state moved on by the steps above, b's separately.
        let sa = a.state_dict();
        let sb = b.state_dict();
        assert_eq!(sa.len(), sb.len());
        for ((ka, ta), (kb, tb)) in sa.iter().zip(&sb) {
            assert_eq!(ka, kb);
            assert!(!ta.shares_storage_with(tb), "{ka} shared");
        }
    }

    #[test]
    fn load_state_dict_errors() {
        let p = param(&[1.0, 2.0]);
        let c = AdamConfig {
            amsgrad: true,
            ..Default::default()
        };
        let mut opt = Adam::new(vec![p], c).unwrap();
        let t = |v: &[f64]| Tensor::from_slice(v, [v.len()], Device::Cpu).unwrap();
        let step = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
        let full = |extra: Option<(&str, Tensor)>| {
            let mut s = vec![
                ("state.0.step".to_string(), step.clone()),
                ("state.0.exp_avg".to_string(), t(&[0.0, 0.0])),
                ("state.0.exp_avg_sq".to_string(), t(&[0.0, 0.0])),
            ];
            if let Some((k, v)) = extra {
                s.push((k.to_string(), v));
            }
            s
        };
        // Missing max_exp_avg_sq with amsgrad, wrong shape, unknown name, bad index, bad step.
        assert!(opt.load_state_dict(&full(None)).is_err());
        assert!(opt
            .load_state_dict(&full(Some(("state.0.max_exp_avg_sq", t(&[0.0])))))
            .is_err());
        assert!(opt
            .load_state_dict(&full(Some(("state.0.momentum_buffer", t(&[0.0, 0.0])))))
            .is_err());
        assert!(opt
            .load_state_dict(&full(Some(("state.3.exp_avg", t(&[0.0, 0.0])))))
            .is_err());
        assert!(opt
            .load_state_dict(&[("state.0.step".to_string(), t(&[1.0, 2.0]))])
            .is_err());
        assert!(
            opt.load_state_dict(&full(None)[..2]).is_err(),
            "incomplete state loaded"
        );
        opt.load_state_dict(&full(Some(("state.0.max_exp_avg_sq", t(&[0.0, 0.0])))))
            .unwrap();
        // The four state tensors, param_groups.0.params and the 7 hyperparameters.
        assert_eq!(opt.state_dict().len(), 12);
    }

    #[test]
    fn config_errors() {
        let bad = [
            AdamConfig {
                lr: -1e-3,
                ..Default::default()
            },
            AdamConfig {
                eps: -1.0,
                ..Default::default()
            },
            AdamConfig {
                betas: (1.0, 0.999),
                ..Default::default()
            },
            AdamConfig {
                betas: (0.9, -0.1),
                ..Default::default()
            },
            AdamConfig {
                weight_decay: -0.01,
                ..Default::default()
            },
            AdamConfig {
                lr: f64::NAN,
                ..Default::default()
            },
        ];
        for c in bad {
            assert!(Adam::new(vec![param(&[1.0])], c).is_err(), "{c:?} accepted");
            assert!(AdamW::new(vec![param(&[1.0])], c).is_err(), "{c:?} accepted");
        }
        assert!(Adam::new(vec![], AdamConfig::default()).is_err());
        let p = [param(&[1.0])];
        let none: [Tensor; 0] = [];
        let slices = AdamStateSlices {
            exp_avgs: &none,
            exp_avg_sqs: &none,
            max_exp_avg_sqs: &none,
            state_steps: &none,
        };
        assert!(adam(&p, &none, slices, &AdamConfig::default(), false).is_err());
    }
}
