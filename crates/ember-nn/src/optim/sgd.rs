//! Stochastic gradient descent with momentum, dampening, Nesterov momentum, weight decay and
//! `maximize` (`torch.optim.SGD`).
//!
//! The update of one parameter, as PyTorch's `_single_tensor_sgd` (op for op):
//! ```text
//! g = maximize ? -grad : grad
//! if weight_decay != 0:  g = g + weight_decay * p
//! if momentum != 0:
//!     buf = first step ? clone(g) : buf * momentum + (1 - dampening) * g   (in place)
//!     g = nesterov ? g + momentum * buf : buf
//! p += -lr * g                                                               (in place)
//! ```

use super::param_group::{split_state, Group, GroupConfig, Groups, Hyper, ParamGroup};
use super::{check_non_negative, check_params, check_state_index, lr_on, zero_grads, Optimizer};
use crate::state_dict::StateDictResult;
use ember_core::fused::{self, GradScaling, SgdStep};
use ember_core::{Error, Result, Tensor};

/// Hyperparameters of [`SGD`]; `Default` is PyTorch's (`lr = 1e-3`, everything else off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl GroupConfig for SgdConfig {
    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn hyperparameters(&self) -> Vec<(&'static str, Hyper)> {
        vec![
            ("lr", Hyper::F64(self.lr)),
            ("momentum", Hyper::F64(self.momentum)),
            ("dampening", Hyper::F64(self.dampening)),
            ("weight_decay", Hyper::F64(self.weight_decay)),
            ("nesterov", Hyper::Bool(self.nesterov)),
            ("maximize", Hyper::Bool(self.maximize)),
        ]
    }

    fn set_hyperparameter(&mut self, name: &str, value: Hyper) {
        match (name, value) {
            ("lr", Hyper::F64(v)) => self.lr = v,
            ("momentum", Hyper::F64(v)) => self.momentum = v,
            ("dampening", Hyper::F64(v)) => self.dampening = v,
            ("weight_decay", Hyper::F64(v)) => self.weight_decay = v,
            ("nesterov", Hyper::Bool(v)) => self.nesterov = v,
            ("maximize", Hyper::Bool(v)) => self.maximize = v,
            _ => debug_assert!(false, "{name} = {value:?} is not an SGD hyperparameter"),
        }
    }

    fn check(&self, _op: &'static str) -> Result<()> {
        self.validate()
    }
}

impl SgdConfig {
    /// These defaults with the overrides of `group` (Note [Param groups]), checked.
    fn for_group(&self, group: &ParamGroup) -> Result<SgdConfig> {
        group.refuse(
            "SGD",
            &[("betas", group.betas.is_some()), ("eps", group.eps.is_some())],
        )?;
        let config = SgdConfig {
            lr: group.lr.unwrap_or(self.lr),
            momentum: group.momentum.unwrap_or(self.momentum),
            dampening: group.dampening.unwrap_or(self.dampening),
            weight_decay: group.weight_decay.unwrap_or(self.weight_decay),
            nesterov: group.nesterov.unwrap_or(self.nesterov),
            ..*self
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the hyperparameters as `torch.optim.SGD.__init__` does.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("SGD", "learning rate", self.lr)?;
        check_non_negative("SGD", "momentum value", self.momentum)?;
        check_non_negative("SGD", "weight_decay value", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::invalid(
                "SGD",
                format!("Invalid dampening value: {}", self.dampening),
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid(
                "SGD",
                "Nesterov momentum requires a momentum and zero dampening",
            ));
        }
        Ok(())
    }
}

/// One SGD update of every `params[i]` from `grads[i]` (PyTorch's functional `sgd`); see the
/// module docs for the formula and Note [Foreach step functions] in `optim`.
/// `momentum_buffers[i]` is `None` before the first step with momentum and is filled here.
pub fn sgd(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: &mut [Option<Tensor>],
    config: &SgdConfig,
) -> Result<()> {
    sgd_scaled(params, grads, momentum_buffers, config, GradScaling::default())
}

/// [`sgd`] under a GradScaler (see Note [Steps under a GradScaler] in `optim`): the gradients
/// are divided by `scaling.grad_scale` (and written back unscaled) and nothing changes when
/// `scaling.found_inf` is nonzero, decided on the device by the fused steps.
///
/// A new momentum buffer is made zero-filled, and its first update `0 * momentum + g` is the
/// `buf = g` of a first step, so a skipped first step leaves a buffer that is still "new".
/// That identity needs `dampening == 0`; with dampening, a first step with new buffers reads
/// the flag on the host instead, as do parameters on the per-tensor path.
pub fn sgd_scaled(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: &mut [Option<Tensor>],
    config: &SgdConfig,
    scaling: GradScaling<'_>,
) -> Result<()> {
    sgd_with_lr(params, grads, momentum_buffers, config, scaling, &[])
}

/// [`sgd_scaled`] whose fused steps read the lr from the tensor of `lrs` on their device, where
/// there is one (Note [Learning rate on the device] in `optim`); it holds `config.lr`.
pub(crate) fn sgd_with_lr(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: &mut [Option<Tensor>],
    config: &SgdConfig,
    scaling: GradScaling<'_>,
    lrs: &[Tensor],
) -> Result<()> {
    if grads.len() != params.len() || momentum_buffers.len() != params.len() {
        return Err(Error::invalid(
            "sgd",
            format!(
                "expected as many gradients and momentum buffers as parameters ({}), got {} and {}",
                params.len(),
                grads.len(),
                momentum_buffers.len()
            ),
        ));
    }
    let _g = ember_core::no_grad();
    let mut scaling = scaling;
    let has_momentum = config.momentum != 0.0;
    // A parameter without a buffer gets a new one, set by its first step.
    let first: Vec<bool> = momentum_buffers
        .iter()
        .map(|b| has_momentum && b.is_none())
        .collect();
    // Under a found-inf flag new buffers start at zero and take the ordinary update (see
    // above), unless dampening makes that differ from a first step: then the host decides.
    let zero_start = scaling.found_inf.is_some() && config.dampening == 0.0;
    if scaling.found_inf.is_some() && !zero_start && first.contains(&true) {
        if super::found_inf_on_host(scaling.found_inf)? {
            return Ok(());
        }
        scaling.found_inf = None;
    }
    for (i, slot) in momentum_buffers.iter_mut().enumerate() {
        if first[i] && fused_shape_ok(&params[i], &grads[i]) {
            *slot = Some(if zero_start {
                grads[i].zeros_like()?
            } else {
                grads[i].empty_like()?
            });
        }
    }
    // Note [Foreach step functions]: one fused call per device, dtype and first step.
    let groups = super::fused_groups(params.len(), scaling.grad_scale.is_none(), |i| {
        // A parameter that needs a buffer but got none above fails the checks on its gradient.
        let mut ts = vec![&params[i], &grads[i]];
        if has_momentum {
            ts.extend(momentum_buffers[i].as_ref());
        }
        ts
    });
    for group in groups.fused {
        for first_step in [true, false] {
            let part: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&i| (first[i] && !zero_start) == first_step)
                .collect();
            if part.is_empty() {
                continue;
            }
            let ps: Vec<Tensor> = part.iter().map(|&i| params[i].clone()).collect();
            let gs: Vec<Tensor> = part.iter().map(|&i| grads[i].clone()).collect();
            let bs: Vec<Tensor> = part.iter().filter_map(|&i| momentum_buffers[i].clone()).collect();
            let step = SgdStep {
                lr: config.lr,
                momentum: config.momentum,
                dampening: config.dampening,
                nesterov: config.nesterov,
                weight_decay: config.weight_decay,
                maximize: config.maximize,
                first_step,
            };
            let device = ps[0].device();
            let on = super::ScalingOn::new(&scaling, device)?;
            let lr = lr_on(lrs, device);
            fused::sgd_scaled_(&ps, &gs, has_momentum.then_some(&bs[..]), &step, on.get(), lr)?;
        }
    }
    for &i in &groups.single {
        if first[i] {
            // A buffer made above for a parameter that went to the per-tensor path.
            momentum_buffers[i] = None;
        }
    }
    if groups.single.is_empty() || super::found_inf_on_host(scaling.found_inf)? {
        return Ok(());
    }
    for i in groups.single {
        super::unscale_grad(&grads[i], scaling.grad_scale)?;
        sgd_single(&params[i], &grads[i], &mut momentum_buffers[i], config)?;
    }
    Ok(())
}

/// Whether a new momentum buffer made like `grad` could take the fused path.
fn fused_shape_ok(param: &Tensor, grad: &Tensor) -> bool {
    grad.dtype() == param.dtype() && grad.device() == param.device() && grad.is_contiguous()
}

/// The per-tensor SGD step of one parameter, for tensors the fused step does not take (see
/// Note [Fused step preconditions] in `ember_core::fused`); the same arithmetic, as composed
/// tensor ops. `slot` is `None` before the first step with momentum and is filled here.
fn sgd_single(param: &Tensor, grad: &Tensor, slot: &mut Option<Tensor>, config: &SgdConfig) -> Result<()> {
    let mut grad = if config.maximize {
        grad.neg()?
    } else {
        grad.clone()
    };
    if config.weight_decay != 0.0 {
        grad = grad.add(&param.mul_scalar(config.weight_decay)?)?;
    }
    if config.momentum != 0.0 {
        let buf = match slot {
            None => {
                let buf = grad.deep_clone()?;
                *slot = Some(buf.clone());
                buf
            }
            Some(buf) => {
                buf.mul_scalar_(config.momentum)?;
                buf.add_scaled_(&grad, 1.0 - config.dampening)?
            }
        };
        grad = if config.nesterov {
            grad.add(&buf.mul_scalar(config.momentum)?)?
        } else {
            buf
        };
    }
    param.add_scaled_(&grad, -config.lr)?;
    Ok(())
}

/// Stochastic gradient descent (`torch.optim.SGD`) over one or more param groups.
#[allow(clippy::upper_case_acronyms)]
pub struct SGD {
    groups: Groups<SgdConfig>,
    /// The config given to `new`/`with_groups`: what a group does not override.
    defaults: SgdConfig,
    /// One entry per parameter of all groups (the optimizer-wide numbering).
    momentum_buffers: Vec<Option<Tensor>>,
}

impl SGD {
    /// An SGD optimizer over `params` (leaf tensors, usually with `requires_grad`), one param
    /// group.
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<SGD> {
        config.validate()?;
        check_params("SGD", &params)?;
        SGD::with_groups(vec![ParamGroup::new(params)], config)
    }

    /// An SGD optimizer over param groups (PyTorch's `SGD([{"params": ..., "lr": ...}, ...],
    /// lr=...)`): each group's hyperparameters are `defaults` with the group's overrides (Note
    /// [Param groups]). Groups may set `lr`, `weight_decay`, `momentum`, `dampening` and
    /// `nesterov`.
    pub fn with_groups(groups: Vec<ParamGroup>, defaults: SgdConfig) -> Result<SGD> {
        defaults.validate()?;
        let groups = groups
            .into_iter()
            .map(|g| {
                let config = defaults.for_group(&g)?;
                Ok((g.params, config))
            })
            .collect::<Result<Vec<_>>>()?;
        let groups = Groups::new("SGD", groups)?;
        let n = groups.params.len();
        Ok(SGD {
            groups,
            defaults,
            momentum_buffers: vec![None; n],
        })
    }

    /// Appends a param group (`add_param_group`): its parameters are numbered after all those
    /// already held; the defaults fill what it does not set.
    pub fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        let config = self.defaults.for_group(&group)?;
        self.groups.push("SGD", group.params, config)?;
        self.momentum_buffers.resize(self.groups.params.len(), None);
        Ok(())
    }

    /// The param groups (`optimizer.param_groups`), each with its complete config.
    pub fn param_groups(&self) -> &[Group<SgdConfig>] {
        &self.groups.groups
    }

    /// The hyperparameters of group 0 (`lr` as currently set); see [`SGD::param_groups`] for
    /// the others.
    pub fn config(&self) -> SgdConfig {
        self.groups.groups[0].config
    }

    /// The config given to `new` or `with_groups` (`optimizer.defaults`): what a group does
    /// not override.
    pub fn defaults(&self) -> SgdConfig {
        self.defaults
    }

    /// The parameters of all groups, in order (the state dict's numbering).
    pub fn params(&self) -> &[Tensor] {
        &self.groups.params
    }
}

impl SGD {
    /// One step of every parameter with a gradient, under `scaling`: one call of the foreach
    /// function per param group (Note [Param groups]).
    fn step_with(&mut self, scaling: GradScaling<'_>) -> Result<()> {
        for group in &mut self.groups.groups {
            let mut params = Vec::new();
            let mut grads = Vec::new();
            let mut bufs = Vec::new();
            let mut index = Vec::new();
            for (p, i) in group.params.iter().zip(group.indices()) {
                if let Some(g) = p.grad() {
                    params.push(p.clone());
                    grads.push(g);
                    bufs.push(self.momentum_buffers[i].clone());
                    index.push(i);
                }
            }
            if params.is_empty() {
                continue;
            }
            let lrs = group.device_lr.for_params(&params, group.config.lr)?;
            sgd_with_lr(&params, &grads, &mut bufs, &group.config, scaling, &lrs)?;
            if group.config.momentum != 0.0 {
                for (i, buf) in index.into_iter().zip(bufs) {
                    self.momentum_buffers[i] = buf;
                }
            }
        }
        Ok(())
    }
}

impl Optimizer for SGD {
    fn step(&mut self) -> Result<()> {
        self.step_with(GradScaling::default())
    }

    fn params(&self) -> &[Tensor] {
        &self.groups.params
    }

    fn supports_amp_scaling(&self) -> bool {
        true
    }

    fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> Result<()> {
        self.step_with(GradScaling {
            grad_scale,
            found_inf: Some(found_inf),
        })
    }

    fn zero_grad(&mut self) -> Result<()> {
        zero_grads(&self.groups.params)
    }

    fn lr(&self) -> f64 {
        self.groups.lr(0)
    }

    fn set_lr(&mut self, lr: f64) {
        self.groups.set_all_lr(lr);
    }

    fn initial_lr(&self) -> Option<f64> {
        self.groups.initial_lr(0)
    }

    fn set_initial_lr(&mut self, lr: f64) {
        for g in 0..self.groups.groups.len() {
            self.groups.set_initial_lr(g, lr);
        }
    }

    fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        SGD::add_param_group(self, group)
    }

    fn num_param_groups(&self) -> usize {
        self.groups.groups.len()
    }

    fn group_lr(&self, group: usize) -> f64 {
        self.groups.lr(group)
    }

    fn set_group_lr(&mut self, group: usize, lr: f64) {
        self.groups.set_lr(group, lr);
    }

    fn group_initial_lr(&self, group: usize) -> Option<f64> {
        self.groups.initial_lr(group)
    }

    fn set_group_initial_lr(&mut self, group: usize, lr: f64) {
        self.groups.set_initial_lr(group, lr);
    }

    fn param_group_state(&self, group: usize) -> Vec<(String, Tensor)> {
        self.groups.group_state(group)
    }

    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .momentum_buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                b.as_ref()
                    .map(|b| (format!("state.{i}.momentum_buffer"), b.clone()))
            })
            .collect();
        self.groups.push_state(&mut out);
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()> {
        const OP: &str = "SGD.load_state_dict";
        let (entries, group_entries) = split_state(OP, state)?;
        let groups = self.groups.load_entries(OP, &group_entries)?;
        let n = self.groups.params.len();
        let mut bufs = vec![None; n];
        for (index, name, value) in entries {
            check_state_index(OP, index, name, n)?;
            if name != "momentum_buffer" {
                return Err(Error::invalid(
                    OP,
                    format!("unexpected state {name:?} in \"state.{index}.{name}\": SGD keeps only \"momentum_buffer\""),
                )
                .into());
            }
            bufs[index] = Some(super::load_like_param(OP, value, &self.groups.params[index])?);
        }
        self.momentum_buffers = bufs;
        self.groups.apply_loaded(groups);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testing::{param, set_grad};
    use ember_core::{DType, Device};

    fn assert_close(t: &Tensor, expected: &[f64]) {
        let got = t.to_vec_f64().unwrap();
        assert_eq!(got.len(), expected.len());
        for (g, e) in got.iter().zip(expected) {
            assert!(
                (g - e).abs() <= 1e-12 * (1.0 + e.abs()),
                "got {got:?}, expected {expected:?}"
            );
        }
    }

    /// Runs SGD on one parameter `p0` with the gradients `grads`, one step each.
    fn run(config: SgdConfig, p0: &[f64], grads: &[&[f64]]) -> Tensor {
        let p = param(p0);
        let mut opt = SGD::new(vec![p.clone()], config).unwrap();
        for g in grads {
            set_grad(&p, g);
            opt.step().unwrap();
        }
        p
    }

    #[test]
    fn plain_step() {
        // p = [1, 2] - 0.1 * [0.5, -1] = [0.95, 2.1]
        let cfg = SgdConfig {
            lr: 0.1,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0, 2.0], &[&[0.5, -1.0]]), &[0.95, 2.1]);
    }

    #[test]
    fn weight_decay_step() {
        // g = [0.5, -1] + 0.1 * [1, 2] = [0.6, -0.8]; p = [1 - 0.06, 2 + 0.08]
        let cfg = SgdConfig {
            lr: 0.1,
            weight_decay: 0.1,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0, 2.0], &[&[0.5, -1.0]]), &[0.94, 2.08]);
    }

    #[test]
    fn momentum_steps() {
        // step 1: buf = 1, p = 1 - 0.1 = 0.9; step 2: buf = 0.9 * 1 + 2 = 2.9, p = 0.9 - 0.29
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0], &[&[1.0], &[2.0]]), &[0.61]);
    }

    #[test]
    fn dampening_steps() {
        // step 1: buf = g = 1 (no dampening on the first step), p = 0.9;
        // step 2: buf = 0.9 * 1 + (1 - 0.5) * 2 = 1.9, p = 0.9 - 0.19 = 0.71
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0], &[&[1.0], &[2.0]]), &[0.71]);
    }

    #[test]
    fn nesterov_steps() {
        // step 1: buf = 1, g = 1 + 0.9 * 1 = 1.9, p = 1 - 0.19 = 0.81;
        // step 2: buf = 0.9 + 2 = 2.9, g = 2 + 0.9 * 2.9 = 4.61, p = 0.81 - 0.461 = 0.349
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0], &[&[1.0], &[2.0]]), &[0.349]);
    }

    #[test]
    fn nesterov_weight_decay_step() {
        // g = 1 + 0.01 * 2 = 1.02; buf = 1.02; g = 1.02 + 0.9 * 1.02 = 1.938; p = 2 - 0.05 * 1.938
        let cfg = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..Default::default()
        };
        assert_close(&run(cfg, &[2.0], &[&[1.0]]), &[2.0 - 0.0969]);
    }

    #[test]
    fn maximize_step() {
        // p = 1 + 0.1 * 1 = 1.1; with weight decay 0.5: g = -1 + 0.5 * 1 = -0.5, p = 1.05
        let cfg = SgdConfig {
            lr: 0.1,
            maximize: true,
            ..Default::default()
        };
        assert_close(&run(cfg, &[1.0], &[&[1.0]]), &[1.1]);
        let cfg = SgdConfig {
            weight_decay: 0.5,
            ..cfg
        };
        assert_close(&run(cfg, &[1.0], &[&[1.0]]), &[1.05]);
    }

    #[test]
    fn momentum_buffer_does_not_alias_grad() {
        // The first buffer is a copy of the gradient: changing the grad later leaves it alone.
        let p = param(&[1.0]);
        let mut opt = SGD::new(
            vec![p.clone()],
            SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..Default::default()
            },
        )
        .unwrap();
        set_grad(&p, &[1.0]);
        opt.step().unwrap();
        {
            let _g = ember_core::no_grad();
            p.grad().unwrap().fill_(5.0).unwrap();
        }
        let state = opt.state_dict();
        assert_eq!(state[0].0, "state.0.momentum_buffer");
        assert_close(&state[0].1, &[1.0]);
    }

    #[test]
    fn skips_params_without_grad_and_zero_grad() {
        let (a, b) = (param(&[1.0]), param(&[2.0]));
        let mut opt = SGD::new(
            vec![a.clone(), b.clone()],
            SgdConfig {
                lr: 0.1,
                momentum: 0.5,
                ..Default::default()
            },
        )
        .unwrap();
        set_grad(&b, &[1.0]);
        opt.step().unwrap();
        assert_close(&a, &[1.0]);
        assert_close(&b, &[1.9]);
        let keys: Vec<String> = opt.state_dict().into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "state.1.momentum_buffer",
                "param_groups.0.params",
                "param_groups.0.lr",
                "param_groups.0.momentum",
                "param_groups.0.dampening",
                "param_groups.0.weight_decay",
                "param_groups.0.nesterov",
                "param_groups.0.maximize"
            ]
        );
        opt.zero_grad().unwrap();
        assert!(a.grad().is_none() && b.grad().is_none());
        // No gradients at all: a step changes nothing.
        opt.step().unwrap();
        assert_close(&b, &[1.9]);
    }

    #[test]
    fn state_dict_round_trip() {
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let (p, q) = (param(&[1.0, -1.0]), param(&[1.0, -1.0]));
        let mut a = SGD::new(vec![p.clone()], cfg).unwrap();
        set_grad(&p, &[1.0, 2.0]);
        a.step().unwrap();
        a.set_lr(0.05);
        // q takes p's values, b takes a's state (lr included).
        {
            let _g = ember_core::no_grad();
            q.copy_(&p).unwrap();
        }
        let mut b = SGD::new(vec![q.clone()], cfg).unwrap();
        b.load_state_dict(&a.state_dict()).unwrap();
        assert_eq!(b.lr(), 0.05);
        set_grad(&p, &[0.5, 0.5]);
        set_grad(&q, &[0.5, 0.5]);
        a.step().unwrap();
        b.step().unwrap();
        assert_eq!(p.to_vec_f64().unwrap(), q.to_vec_f64().unwrap());
    }

    #[test]
    fn load_state_dict_errors() {
        let p = param(&[1.0, 2.0]);
        let mut opt = SGD::new(vec![p], SgdConfig::default()).unwrap();
        let t = |v: &[f64]| Tensor::from_slice(v, [v.len()], Device::Cpu).unwrap();
        let bad = [
            vec![("state.1.momentum_buffer".to_string(), t(&[1.0, 2.0]))],
            vec![("state.0.momentum_buffer".to_string(), t(&[1.0]))],
            vec![("state.0.exp_avg".to_string(), t(&[1.0, 2.0]))],
            vec![("momentum_buffer".to_string(), t(&[1.0, 2.0]))],
            vec![("param_groups.0.betas".to_string(), t(&[1.0]))],
        ];
        for state in bad {
            assert!(opt.load_state_dict(&state).is_err(), "{:?} loaded", state[0].0);
        }
        // A failed load leaves the state as it was.
        assert_eq!(opt.lr(), 1e-3);
    }

    #[test]
    fn config_errors() {
        let p = || vec![param(&[1.0])];
        let bad = [
            SgdConfig {
                lr: -0.1,
                ..Default::default()
            },
            SgdConfig {
                lr: f64::NAN,
                ..Default::default()
            },
            SgdConfig {
                momentum: -0.5,
                ..Default::default()
            },
            SgdConfig {
                weight_decay: -1.0,
                ..Default::default()
            },
            SgdConfig {
                nesterov: true,
                ..Default::default()
            },
            SgdConfig {
                nesterov: true,
                momentum: 0.9,
                dampening: 0.1,
                ..Default::default()
            },
        ];
        for cfg in bad {
            assert!(SGD::new(p(), cfg).is_err(), "{cfg:?} accepted");
        }
        assert!(SGD::new(vec![], SgdConfig::default()).is_err());
        let non_leaf = param(&[1.0]).mul_scalar(2.0).unwrap();
        assert!(SGD::new(vec![non_leaf], SgdConfig::default()).is_err());
        assert!(sgd(&p(), &[], &mut [], &SgdConfig::default()).is_err());
    }

    #[test]
    fn f32_params() {
        let p = Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        p.set_grad(Some(
            Tensor::from_slice(&[0.5f32, -1.0], [2], Device::Cpu).unwrap(),
        ))
        .unwrap();
        let mut opt = SGD::new(
            vec![p.clone()],
            SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..Default::default()
            },
        )
        .unwrap();
        opt.step().unwrap();
        assert_eq!(p.dtype(), DType::F32);
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.95, 2.1]);
    }
}
