//! Parameter groups (`optimizer.param_groups`): [`ParamGroup`], a list of parameters with
//! hyperparameters that override the optimizer's defaults, as a user passes it to
//! `with_groups` or `add_param_group`, and [`Group`], one group as an optimizer holds it
//! (parameters, complete hyperparameters, `initial_lr`, the lr on the device).
//!
//! Note [Param groups]: the rules, PyTorch's (`torch.optim.Optimizer.add_param_group`):
//! - A group's hyperparameters are the optimizer's defaults (the config given to
//!   `with_groups`) with the group's overrides on top; each group is checked as a whole config
//!   would be. An override the optimizer has no use for (`momentum` for Adam) is an error, not
//!   ignored. `amsgrad`, `maximize` and `fused` come from the defaults (a `ParamGroup` does
//!   not set them), but each group holds and uses its own, which a loaded state dict sets as
//!   it sets every other hyperparameter (Note [State dict format]).
//! - Parameters are numbered across groups in order, group 0's first: parameter `i` of the
//!   state dict and of [`Optimizer::params`](super::Optimizer::params) is the `i`-th of all
//!   groups' parameters together (PyTorch's state dict numbering). `add_param_group` appends,
//!   so earlier numbers never change.
//! - A parameter may be in one group only (PyTorch: "some parameters appear in more than one
//!   parameter group"); a group may be empty, but the optimizer needs at least one group.
//! - Each group has its own lr, `initial_lr` and device lr tensor (Note [Learning rate on the
//!   device]); the step is one call of the foreach function per group, so each group's
//!   parameters are fused by device and dtype as one group's were (Note [Foreach step
//!   functions]).
//! - `Optimizer::lr()` is group 0's lr and `set_lr` sets every group's (what nanoGPT's
//!   `for g in optimizer.param_groups: g["lr"] = lr` does); schedulers scale each group from
//!   its own `initial_lr` through the `group_*` methods.

use super::StateKey;
use crate::state_dict::{StateDictError, StateDictResult};
use ember_core::{DType, Device, Error, Result, Tensor};
use std::fmt;
use std::ops::Range;

/// A group of parameters with its own hyperparameters (an entry of the list PyTorch's
/// optimizers take: `{"params": [...], "lr": 1e-3, "weight_decay": 0.0}`). Unset
/// hyperparameters take the optimizer's defaults; see Note [Param groups].
///
/// ```
/// # use ember_core::{Device, Tensor};
/// # use ember_nn::optim::{AdamConfig, AdamW, ParamGroup};
/// # let w = Tensor::zeros([4, 4], ember_core::DType::F32, Device::Cpu)?.requires_grad_(true)?;
/// # let b = Tensor::zeros([4], ember_core::DType::F32, Device::Cpu)?.requires_grad_(true)?;
/// let opt = AdamW::with_groups(
///     vec![ParamGroup::new(vec![w]), ParamGroup::new(vec![b]).weight_decay(0.0)],
///     AdamConfig { lr: 6e-4, weight_decay: 0.1, ..AdamConfig::adamw() },
/// )?;
/// assert_eq!(opt.param_groups()[1].config().weight_decay, 0.0);
/// # Ok::<(), ember_core::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct ParamGroup {
    pub(crate) params: Vec<Tensor>,
    pub(crate) lr: Option<f64>,
    pub(crate) weight_decay: Option<f64>,
    pub(crate) betas: Option<(f64, f64)>,
    pub(crate) eps: Option<f64>,
    pub(crate) momentum: Option<f64>,
    pub(crate) dampening: Option<f64>,
    pub(crate) nesterov: Option<bool>,
}

impl ParamGroup {
    /// A group of `params` with the optimizer's default hyperparameters.
    pub fn new(params: Vec<Tensor>) -> ParamGroup {
        ParamGroup {
            params,
            ..ParamGroup::default()
        }
    }

    /// The group's learning rate.
    pub fn lr(mut self, lr: f64) -> ParamGroup {
        self.lr = Some(lr);
        self
    }

    /// The group's weight decay (Adam's L2 penalty, AdamW's decoupled decay, SGD's L2 penalty).
    pub fn weight_decay(mut self, weight_decay: f64) -> ParamGroup {
        self.weight_decay = Some(weight_decay);
        self
    }

    /// The group's `betas` (Adam and AdamW).
    pub fn betas(mut self, betas: (f64, f64)) -> ParamGroup {
        self.betas = Some(betas);
        self
    }

    /// The group's `eps` (Adam and AdamW).
    pub fn eps(mut self, eps: f64) -> ParamGroup {
        self.eps = Some(eps);
        self
    }

    /// The group's momentum (SGD).
    pub fn momentum(mut self, momentum: f64) -> ParamGroup {
        self.momentum = Some(momentum);
        self
    }

    /// The group's dampening (SGD).
    pub fn dampening(mut self, dampening: f64) -> ParamGroup {
        self.dampening = Some(dampening);
        self
    }

    /// Whether the group uses Nesterov momentum (SGD).
    pub fn nesterov(mut self, nesterov: bool) -> ParamGroup {
        self.nesterov = Some(nesterov);
        self
    }

    /// The group's parameters.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// A group of `params` with this group's hyperparameter overrides (how
    /// `ZeroRedundancyOptimizer` gives each rank its share of a group).
    pub fn with_params(&self, params: Vec<Tensor>) -> ParamGroup {
        ParamGroup {
            params,
            ..self.clone()
        }
    }

    /// Errors naming the first of `names` (pairs of a hyperparameter's name and whether this
    /// group sets it) that the group sets: those `optimizer` does not have.
    pub(crate) fn refuse(&self, optimizer: &'static str, names: &[(&str, bool)]) -> Result<()> {
        match names.iter().find(|(_, set)| *set) {
            Some((name, _)) => Err(Error::invalid(
                optimizer,
                format!(
                    "a param group sets {name}, which {optimizer} does not have; remove it from the group"
                ),
            )),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for ParamGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamGroup")
            .field("params", &shapes(&self.params))
            .field("lr", &self.lr)
            .field("weight_decay", &self.weight_decay)
            .field("betas", &self.betas)
            .field("eps", &self.eps)
            .field("momentum", &self.momentum)
            .field("dampening", &self.dampening)
            .field("nesterov", &self.nesterov)
            .finish()
    }
}

fn shapes(params: &[Tensor]) -> Vec<String> {
    params.iter().map(|p| p.shape().to_string()).collect()
}

impl From<Vec<Tensor>> for ParamGroup {
    fn from(params: Vec<Tensor>) -> ParamGroup {
        ParamGroup::new(params)
    }
}

/// A hyperparameter config (what the shared group code needs of one): its learning rate, and
/// all its hyperparameters as the state dict holds them (Note [State dict format] in `optim`).
pub(crate) trait GroupConfig: Copy {
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);

    /// Every hyperparameter under PyTorch's name, in the order of PyTorch's
    /// `param_groups[g]` (`lr` first).
    fn hyperparameters(&self) -> Vec<(&'static str, Hyper)>;

    /// Sets hyperparameter `name` (one of [`GroupConfig::hyperparameters`]') to `value`, of the
    /// kind that lists it.
    fn set_hyperparameter(&mut self, name: &str, value: Hyper);

    /// Checks the hyperparameters as the optimizer's constructor does.
    fn check(&self, op: &'static str) -> Result<()>;
}

/// One hyperparameter of a param group, and how the state dict holds it (Note [State dict
/// format] in `optim`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Hyper {
    /// A number (`lr`, `eps`, `momentum`, ...): a 0-d f64 tensor.
    F64(f64),
    /// A pair (`betas`): a 1-d f64 tensor of two values.
    Pair(f64, f64),
    /// A switch (`amsgrad`, `nesterov`, ...): a 0-d bool tensor.
    Bool(bool),
    /// A switch that may be unset (`fused`; PyTorch's `None`): a 0-d bool tensor, or a 1-d
    /// bool tensor of no elements for `None`.
    OptBool(Option<bool>),
}

impl Hyper {
    /// The value as a CPU tensor.
    pub(crate) fn to_tensor(self) -> Result<Tensor> {
        match self {
            Hyper::F64(v) => Tensor::scalar(v, DType::F64, Device::Cpu),
            Hyper::Pair(a, b) => Tensor::from_vec(vec![a, b], [2], Device::Cpu),
            Hyper::Bool(v) | Hyper::OptBool(Some(v)) => Tensor::from_vec(vec![v], [], Device::Cpu),
            Hyper::OptBool(None) => Tensor::from_vec(Vec::<bool>::new(), [0], Device::Cpu),
        }
    }

    /// `t` read as a value of this kind; the error (`key` is the tensor's key) says what the
    /// kind needs.
    pub(crate) fn read_like(self, op: &'static str, key: &str, t: &Tensor) -> Result<Hyper> {
        let want = match self {
            Hyper::F64(_) => "a 0-d floating-point tensor",
            Hyper::Pair(..) => "a 1-d floating-point tensor of two values",
            Hyper::Bool(_) => "a 0-d bool tensor",
            Hyper::OptBool(_) => "a 0-d bool tensor, or a 1-d bool tensor of no elements for None",
        };
        let bad = || {
            Error::invalid(
                op,
                format!(
                    "state dict entry {key:?} must be {want}, it is a {:?} tensor of shape {}; write it as the optimizer's state_dict() does",
                    t.dtype(),
                    t.shape()
                ),
            )
        };
        let float = t.dtype().is_floating_point();
        let boolean = t.dtype() == DType::Bool;
        Ok(match self {
            Hyper::F64(_) if float && t.rank() == 0 => Hyper::F64(t.item_f64()?),
            Hyper::Pair(..) if float && t.rank() == 1 && t.numel() == 2 => {
                let v = t.to_vec_f64()?;
                Hyper::Pair(v[0], v[1])
            }
            Hyper::Bool(_) if boolean && t.rank() == 0 => Hyper::Bool(t.item_f64()? != 0.0),
            Hyper::OptBool(_) if boolean && t.rank() == 0 => Hyper::OptBool(Some(t.item_f64()? != 0.0)),
            Hyper::OptBool(_) if boolean && t.rank() == 1 && t.numel() == 0 => Hyper::OptBool(None),
            _ => return Err(bad()),
        })
    }
}

/// The learning rate of one group in device memory: one 0-d f64 tensor per GPU the group's
/// parameters are on, made on first use (Note [Learning rate on the device]).
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

/// One of an optimizer's param groups (an entry of PyTorch's `optimizer.param_groups`): its
/// parameters and its complete hyperparameters, `C` being the optimizer's config type
/// ([`AdamConfig`](super::AdamConfig), [`SgdConfig`](super::SgdConfig)) with `lr` as set now.
pub struct Group<C> {
    pub(crate) params: Vec<Tensor>,
    /// The optimizer-wide index of `params[0]`.
    pub(crate) first: usize,
    pub(crate) config: C,
    pub(crate) initial_lr: Option<f64>,
    pub(crate) device_lr: DeviceLr,
}

impl<C> Group<C> {
    /// The group's parameters.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// The group's hyperparameters (its `lr` as currently set).
    pub fn config(&self) -> &C {
        &self.config
    }

    /// The group's `initial_lr`: recorded by the first LR scheduler built on the optimizer.
    pub fn initial_lr(&self) -> Option<f64> {
        self.initial_lr
    }

    /// The optimizer-wide indices of the group's parameters (their numbers in the state dict
    /// and in `Optimizer::params`).
    pub fn indices(&self) -> Range<usize> {
        self.first..self.first + self.params.len()
    }
}

impl<C: fmt::Debug> fmt::Debug for Group<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("params", &shapes(&self.params))
            .field("indices", &self.indices())
            .field("config", &self.config)
            .field("initial_lr", &self.initial_lr)
            .finish()
    }
}

/// An optimizer's param groups and all their parameters in one list (what
/// [`Optimizer::params`](super::Optimizer::params) returns).
pub(crate) struct Groups<C> {
    pub(crate) params: Vec<Tensor>,
    pub(crate) groups: Vec<Group<C>>,
}

impl<C: GroupConfig> Groups<C> {
    /// Groups of `(params, config)`, each checked by [`Groups::push`]; at least one.
    pub(crate) fn new(op: &'static str, groups: Vec<(Vec<Tensor>, C)>) -> Result<Groups<C>> {
        if groups.is_empty() {
            return Err(Error::invalid(op, "optimizer got an empty list of param groups"));
        }
        let mut out = Groups {
            params: Vec::new(),
            groups: Vec::new(),
        };
        for (params, config) in groups {
            out.push(op, params, config)?;
        }
        Ok(out)
    }

    /// Appends a group (PyTorch's `add_param_group`): leaves only, none already in a group.
    pub(crate) fn push(&mut self, op: &'static str, params: Vec<Tensor>, config: C) -> Result<()> {
        let g = self.groups.len();
        if let Some(i) = params.iter().position(|p| !p.is_leaf()) {
            return Err(Error::invalid(
                op,
                format!("can't optimize a non-leaf Tensor (parameter {i} of param group {g}); pass x.detach().requires_grad_(true) instead"),
            ));
        }
        for (i, p) in params.iter().enumerate() {
            if let Some(j) = self.params.iter().position(|q| q.is_same(p)) {
                return Err(Error::invalid(
                    op,
                    format!("some parameters appear in more than one parameter group: parameter {i} of param group {g} is parameter {j}, already in group {}", self.group_of(j)),
                ));
            }
        }
        self.params.extend(params.iter().cloned());
        self.groups.push(Group {
            first: self.params.len() - params.len(),
            params,
            config,
            initial_lr: None,
            device_lr: DeviceLr::default(),
        });
        Ok(())
    }

    /// The group holding parameter `i` (an optimizer-wide index).
    pub(crate) fn group_of(&self, i: usize) -> usize {
        self.groups.partition_point(|g| g.first + g.params.len() <= i)
    }

    pub(crate) fn lr(&self, group: usize) -> f64 {
        self.groups[group].config.lr()
    }

    pub(crate) fn set_lr(&mut self, group: usize, lr: f64) {
        let g = &mut self.groups[group];
        g.config.set_lr(lr);
        g.device_lr.set(lr);
    }

    pub(crate) fn set_all_lr(&mut self, lr: f64) {
        for g in 0..self.groups.len() {
            self.set_lr(g, lr);
        }
    }

    pub(crate) fn initial_lr(&self, group: usize) -> Option<f64> {
        self.groups[group].initial_lr
    }

    pub(crate) fn set_initial_lr(&mut self, group: usize, lr: f64) {
        self.groups[group].initial_lr = Some(lr);
    }

    /// The entries of group `g` in the state dict but `params`: its hyperparameters, then
    /// `initial_lr` when set (Note [State dict format] in `optim`), unprefixed.
    pub(crate) fn group_state(&self, g: usize) -> Vec<(String, Tensor)> {
        let group = &self.groups[g];
        let mut values = group.config.hyperparameters();
        if let Some(v) = group.initial_lr {
            values.push(("initial_lr", Hyper::F64(v)));
        }
        // Small CPU tensors: making them fails only when the host is out of memory.
        values
            .into_iter()
            .filter_map(|(name, v)| Some((name.to_owned(), v.to_tensor().ok()?)))
            .collect()
    }

    /// Appends `param_groups.{g}.params` and [`Groups::group_state`] of every group.
    pub(crate) fn push_state(&self, out: &mut Vec<(String, Tensor)>) {
        for (g, group) in self.groups.iter().enumerate() {
            let indices: Vec<i64> = group.indices().map(|i| i as i64).collect();
            if let Ok(t) = Tensor::from_vec(indices, [group.params.len()], Device::Cpu) {
                out.push((format!("param_groups.{g}.params"), t));
            }
            out.extend(
                self.group_state(g)
                    .into_iter()
                    .map(|(name, t)| (format!("param_groups.{g}.{name}"), t)),
            );
        }
    }

    /// Checks the `param_groups.*` entries of a state dict against the groups and returns each
    /// group's config and `initial_lr` as loading them makes them; changes nothing. `entries`
    /// are the parsed `(group, name, value)` of the state dict.
    ///
    /// The state dict must have as many groups as the optimizer when it has any group entry;
    /// a group's `params` entry, where present, must list the optimizer-wide indices of that
    /// group. A state dict without `params` entries (written before groups existed) is taken
    /// by its group count alone. A hyperparameter the state dict does not hold (one written
    /// before it kept them all holds only `lr`) keeps the group's value; the loaded config
    /// must pass the constructor's checks.
    pub(crate) fn load_entries(
        &self,
        op: &'static str,
        entries: &[(usize, &str, &Tensor)],
    ) -> StateDictResult<Vec<(C, Option<f64>)>> {
        if let Some(max) = entries.iter().map(|(g, _, _)| *g).max() {
            if max + 1 != self.groups.len() {
                return Err(StateDictError::ParamGroupCount {
                    optimizer: op,
                    expected: self.groups.len(),
                    found: max + 1,
                });
            }
        }
        for &(g, name, value) in entries {
            if name != "params" {
                continue;
            }
            let expected = self.groups[g].indices();
            if value.rank() != 1 || value.dtype().is_floating_point() {
                return Err(Error::invalid(
                    op,
                    format!("\"param_groups.{g}.params\" must be a 1-d integer tensor of parameter indices, it is a {:?} tensor of shape {}", value.dtype(), value.shape()),
                )
                .into());
            }
            if value.numel() != expected.len() {
                return Err(StateDictError::ParamGroupSize {
                    optimizer: op,
                    group: g,
                    expected: expected.len(),
                    found: value.numel(),
                });
            }
            let listed: Vec<f64> = value.to_vec_f64()?;
            if listed.iter().zip(expected.clone()).any(|(&v, i)| v != i as f64) {
                return Err(Error::invalid(
                    op,
                    format!("\"param_groups.{g}.params\" lists parameters {listed:?}, expected {expected:?}: the parameters numbered across groups in order"),
                )
                .into());
            }
        }
        let mut out: Vec<(C, Option<f64>)> = self.groups.iter().map(|g| (g.config, g.initial_lr)).collect();
        for &(g, name, value) in entries {
            let key = format!("param_groups.{g}.{name}");
            let (config, initial_lr) = &mut out[g];
            if name == "params" {
                continue;
            }
            if name == "initial_lr" {
                if let Hyper::F64(v) = Hyper::F64(0.0).read_like(op, &key, value)? {
                    *initial_lr = Some(v);
                }
                continue;
            }
            let known = config.hyperparameters();
            let Some(&(_, kind)) = known.iter().find(|(n, _)| *n == name) else {
                let names: Vec<&str> = known.iter().map(|(n, _)| *n).collect();
                return Err(Error::invalid(
                    op,
                    format!("unexpected param group entry {key:?} in state dict: a param group of this optimizer holds \"params\", {} and \"initial_lr\"; load a state dict written by the same kind of optimizer", names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")),
                )
                .into());
            };
            config.set_hyperparameter(name, kind.read_like(op, &key, value)?);
        }
        for (g, (config, _)) in out.iter().enumerate() {
            config.check(op).map_err(|e| {
                let why = match e {
                    Error::InvalidArgument { msg, .. } => msg,
                    other => other.to_string(),
                };
                Error::invalid(
                    op,
                    format!("the hyperparameters of param group {g} in the state dict are invalid ({why}); load a state dict the optimizer's state_dict() wrote"),
                )
            })?;
        }
        Ok(out)
    }

    /// Sets every group's config and `initial_lr` to `loaded` (from [`Groups::load_entries`]),
    /// the lr on the device too.
    pub(crate) fn apply_loaded(&mut self, loaded: Vec<(C, Option<f64>)>) {
        for (g, (config, initial_lr)) in loaded.into_iter().enumerate() {
            self.groups[g].config = config;
            self.set_lr(g, config.lr());
            self.groups[g].initial_lr = initial_lr;
        }
    }
}

/// The parsed keys of a state dict, split into parameter state `(index, name, value)` and
/// param group entries `(group, name, value)`; see Note [State dict format]. Parameter
/// indices are checked later (after the group checks, whose errors say more).
pub(crate) type SplitState<'a> = (
    Vec<(usize, &'a str, &'a Tensor)>,
    Vec<(usize, &'a str, &'a Tensor)>,
);

/// Splits `state` (see [`SplitState`]).
pub(crate) fn split_state<'a>(op: &'static str, state: &'a [(String, Tensor)]) -> Result<SplitState<'a>> {
    let (mut params, mut groups) = (Vec::new(), Vec::new());
    for (key, value) in state {
        match super::parse_state_key(op, key)? {
            StateKey::Param { index, name } => params.push((index, name, value)),
            StateKey::Group { group, name } => groups.push((group, name, value)),
        }
    }
    Ok((params, groups))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testing::{param, set_grad};
    use crate::optim::{
        Adam, AdamConfig, AdamW, CosineAnnealingLR, LRScheduler, LinearLR, Optimizer, SequentialLR,
        SgdConfig, StepLR, SGD,
    };

    fn values(p: &Tensor) -> Vec<f64> {
        p.to_vec_f64().unwrap()
    }

    fn entry<'a>(state: &'a [(String, Tensor)], key: &str) -> &'a Tensor {
        &state
            .iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("no {key}"))
            .1
    }

    fn sgd_groups(lrs: [f64; 2]) -> SGD {
        SGD::with_groups(
            vec![
                ParamGroup::new(vec![param(&[1.0])]),
                ParamGroup::new(vec![param(&[2.0])]).lr(lrs[1]),
            ],
            SgdConfig {
                lr: lrs[0],
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn adamw_two_groups_first_step_by_hand() {
        // Group 0: lr 0.01, decay 0.1: p = 1 * (1 - 0.001) - 0.01 * g / (|g| + eps).
        // Group 1: lr 0.1, no decay:   p = 2 - 0.1 * g / (|g| + eps).
        let (a, b) = (param(&[1.0]), param(&[2.0]));
        let mut opt = AdamW::with_groups(
            vec![
                ParamGroup::new(vec![a.clone()]),
                ParamGroup::new(vec![b.clone()]).lr(0.1).weight_decay(0.0),
            ],
            AdamConfig {
                lr: 0.01,
                weight_decay: 0.1,
                ..AdamConfig::adamw()
            },
        )
        .unwrap();
        set_grad(&a, &[0.5]);
        set_grad(&b, &[-2.0]);
        opt.step().unwrap();
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        close(values(&a)[0], 0.999 - 0.01 * 0.5 / (0.5 + 1e-8));
        close(values(&b)[0], 2.0 + 0.1 * 2.0 / (2.0 + 1e-8));
        let groups = opt.param_groups();
        assert_eq!(
            (groups[0].config().lr, groups[0].config().weight_decay),
            (0.01, 0.1)
        );
        assert_eq!(
            (groups[1].config().lr, groups[1].config().weight_decay),
            (0.1, 0.0)
        );
        assert_eq!(
            groups[1].config().betas,
            (0.9, 0.999),
            "a default the group keeps"
        );
        assert_eq!((groups[0].indices(), groups[1].indices()), (0..1, 1..2));
        assert_eq!(opt.defaults().lr, 0.01);
        assert_eq!(opt.config().lr, 0.01);
    }

    #[test]
    fn lr_is_group_0s_and_set_lr_sets_every_group() {
        let mut opt = sgd_groups([1.0, 0.1]);
        assert_eq!((opt.num_param_groups(), opt.lr()), (2, 1.0));
        assert_eq!(opt.group_lrs(), [1.0, 0.1]);
        opt.set_group_lr(1, 0.2);
        assert_eq!(opt.group_lrs(), [1.0, 0.2]);
        opt.set_lr(0.5);
        assert_eq!(opt.group_lrs(), [0.5, 0.5]);
        opt.set_initial_lr(0.25);
        assert_eq!(
            (opt.group_initial_lr(0), opt.group_initial_lr(1)),
            (Some(0.25), Some(0.25))
        );
    }

    #[test]
    fn add_param_group_numbers_after_the_others() {
        let (a, b, c) = (param(&[1.0]), param(&[2.0, 3.0]), param(&[4.0]));
        let mut opt = Adam::new(vec![a.clone(), b.clone()], AdamConfig::default()).unwrap();
        opt.add_param_group(ParamGroup::new(vec![c.clone()]).lr(0.5).eps(1e-6))
            .unwrap();
        assert_eq!(opt.param_groups()[1].indices(), 2..3);
        assert_eq!(opt.param_groups()[1].config().eps, 1e-6);
        assert_eq!(Optimizer::params(&opt).len(), 3);
        assert!(Optimizer::params(&opt)[2].is_same(&c));
        set_grad(&c, &[1.0]);
        opt.step().unwrap();
        // p -= lr * g / (|g| + eps) on the first step.
        assert!((values(&c)[0] - (4.0 - 0.5 / (1.0 + 1e-6))).abs() < 1e-12);
        let state = opt.state_dict();
        assert_eq!(entry(&state, "state.2.step").to_vec::<f32>().unwrap(), [1.0]);
        assert_eq!(
            entry(&state, "param_groups.1.params").to_vec::<i64>().unwrap(),
            [2]
        );
        assert_eq!(
            entry(&state, "param_groups.0.params").to_vec::<i64>().unwrap(),
            [0, 1]
        );
        assert_eq!(entry(&state, "param_groups.1.lr").item_f64().unwrap(), 0.5);
        // Already held, in another group or the same.
        assert!(opt.add_param_group(ParamGroup::new(vec![a.clone()])).is_err());
        assert_eq!(opt.num_param_groups(), 2, "a refused group is not added");
    }

    #[test]
    fn groups_are_checked() {
        let p = || param(&[1.0]);
        let adam =
            |g: ParamGroup| AdamW::with_groups(vec![ParamGroup::new(vec![p()]), g], AdamConfig::adamw());
        let sgd = |g: ParamGroup| SGD::with_groups(vec![g], SgdConfig::default());
        // What the optimizer does not have, and values its __init__ refuses.
        for g in [
            ParamGroup::new(vec![p()]).momentum(0.9),
            ParamGroup::new(vec![p()]).nesterov(true),
            ParamGroup::new(vec![p()]).lr(-1.0),
            ParamGroup::new(vec![p()]).betas((1.0, 0.9)),
            ParamGroup::new(vec![p()]).weight_decay(f64::NAN),
        ] {
            assert!(adam(g.clone()).is_err(), "{g:?} accepted by AdamW");
        }
        for g in [
            ParamGroup::new(vec![p()]).betas((0.9, 0.99)),
            ParamGroup::new(vec![p()]).eps(1e-6),
            ParamGroup::new(vec![p()]).nesterov(true),
            ParamGroup::new(vec![p()])
                .momentum(0.9)
                .dampening(0.1)
                .nesterov(true),
            ParamGroup::new(vec![p()]).momentum(-0.9),
        ] {
            assert!(sgd(g.clone()).is_err(), "{g:?} accepted by SGD");
        }
        let e = adam(ParamGroup::new(vec![p()]).momentum(0.9)).err().unwrap();
        assert!(e.to_string().contains("momentum"), "{e}");
        // A group's nesterov needs its momentum, which the group may set itself.
        assert!(sgd(ParamGroup::new(vec![p()]).momentum(0.9).nesterov(true)).is_ok());
        // One parameter in two groups; a non-leaf; no groups at all.
        let shared = p();
        let e = AdamW::with_groups(
            vec![
                ParamGroup::new(vec![p(), shared.clone()]),
                ParamGroup::new(vec![shared]),
            ],
            AdamConfig::adamw(),
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("more than one parameter group"), "{e}");
        let non_leaf = p().mul_scalar(2.0).unwrap();
        assert!(sgd(ParamGroup::new(vec![non_leaf])).is_err());
        assert!(Adam::with_groups(vec![], AdamConfig::default()).is_err());
        // An empty group is allowed (PyTorch's), and steps as a no-op.
        let mut opt = SGD::with_groups(vec![ParamGroup::new(vec![])], SgdConfig::default()).unwrap();
        opt.step().unwrap();
    }

    #[test]
    fn state_dict_round_trip_with_two_groups() {
        // AdamW over groups [a, b] (lr 0.01, decay 0.1) and [c] (lr 0.02, no decay, betas
        // (0.8, 0.9)); a scheduler records both initial_lrs; a copy loads the state and the two
        // go on in step.
        let make = |ps: &[Tensor]| {
            AdamW::with_groups(
                vec![
                    ParamGroup::new(ps[..2].to_vec()),
                    ParamGroup::new(ps[2..].to_vec())
                        .lr(0.02)
                        .weight_decay(0.0)
                        .betas((0.8, 0.9)),
                ],
                AdamConfig {
                    lr: 0.01,
                    weight_decay: 0.1,
                    amsgrad: true,
                    ..AdamConfig::adamw()
                },
            )
            .unwrap()
        };
        let ps = [param(&[1.0, -1.0]), param(&[0.5]), param(&[2.0, 0.0, -3.0])];
        let qs: Vec<Tensor> = ps.iter().map(|p| param(&values(p))).collect();
        let grads = |t: usize| -> Vec<Vec<f64>> {
            ps.iter()
                .enumerate()
                .map(|(i, p)| {
                    (0..p.numel())
                        .map(|j| ((t * 7 + i * 3 + j) as f64).sin())
                        .collect()
                })
                .collect()
        };
        let mut a = make(&ps);
        let mut sched = StepLR::new(&mut a, 1, 0.5).unwrap();
        for t in 0..3 {
            for (p, g) in ps.iter().zip(grads(t)) {
                set_grad(p, &g);
            }
            a.step().unwrap();
            sched.step(&mut a);
        }
        let state = a.state_dict();
        assert_eq!(
            entry(&state, "param_groups.1.params").to_vec::<i64>().unwrap(),
            [2]
        );
        assert_eq!(
            entry(&state, "param_groups.1.initial_lr").item_f64().unwrap(),
            0.02
        );
        assert_eq!(entry(&state, "param_groups.1.lr").item_f64().unwrap(), 0.02 / 8.0);
        assert_eq!(entry(&state, "state.2.step").to_vec::<f32>().unwrap(), [3.0]);
        let mut b = make(&qs);
        {
            let _g = ember_core::no_grad();
            for (p, q) in ps.iter().zip(&qs) {
                q.copy_(p).unwrap();
            }
        }
        b.load_state_dict(&state).unwrap();
        assert_eq!(b.group_lrs(), [0.01 / 8.0, 0.02 / 8.0]);
        assert_eq!(
            (b.group_initial_lr(0), b.group_initial_lr(1)),
            (Some(0.01), Some(0.02))
        );
        for t in 3..6 {
            for ((p, q), g) in ps.iter().zip(&qs).zip(grads(t)) {
                set_grad(p, &g);
                set_grad(q, &g);
            }
            a.step().unwrap();
            b.step().unwrap();
        }
        for (p, q) in ps.iter().zip(&qs) {
            assert_eq!(values(p), values(q));
        }
        let keys = |s: Vec<(String, Tensor)>| s.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(keys(a.state_dict()), keys(b.state_dict()));
    }

    #[test]
    fn sgd_state_dict_round_trip_with_two_groups() {
        let make = |ps: &[Tensor]| {
            SGD::with_groups(
                vec![
                    ParamGroup::new(vec![ps[0].clone()]).momentum(0.9),
                    ParamGroup::new(vec![ps[1].clone()]).lr(0.5),
                ],
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let ps = [param(&[1.0]), param(&[2.0])];
        let qs = [param(&[1.0]), param(&[2.0])];
        let mut a = make(&ps);
        for p in &ps {
            set_grad(p, &[1.0]);
        }
        a.step().unwrap();
        // Group 0 keeps a momentum buffer, group 1 (no momentum) none.
        let state = a.state_dict();
        // Each group with all of SGD's hyperparameters, PyTorch's names in PyTorch's order.
        let keys: Vec<&str> = state.iter().map(|(k, _)| k.as_str()).collect();
        let mut want = vec!["state.0.momentum_buffer".to_string()];
        for g in 0..2 {
            for name in [
                "params",
                "lr",
                "momentum",
                "dampening",
                "weight_decay",
                "nesterov",
                "maximize",
            ] {
                want.push(format!("param_groups.{g}.{name}"));
            }
        }
        assert_eq!(keys, want);
        assert_eq!(entry(&state, "param_groups.0.momentum").item_f64().unwrap(), 0.9);
        assert_eq!(entry(&state, "param_groups.1.momentum").item_f64().unwrap(), 0.0);
        assert_eq!(entry(&state, "param_groups.1.lr").item_f64().unwrap(), 0.5);
        assert_eq!(entry(&state, "param_groups.1.nesterov").dtype(), DType::Bool);
        assert_eq!((values(&ps[0]), values(&ps[1])), (vec![0.9], vec![1.5]));
        let mut b = make(&qs);
        {
            let _g = ember_core::no_grad();
            qs[0].copy_(&ps[0]).unwrap();
            qs[1].copy_(&ps[1]).unwrap();
        }
        b.load_state_dict(&state).unwrap();
        for (p, q) in ps.iter().zip(&qs) {
            set_grad(p, &[2.0]);
            set_grad(q, &[2.0]);
        }
        a.step().unwrap();
        b.step().unwrap();
        // Group 0: buf = 0.9 + 2 = 2.9, p = 0.9 - 0.29; group 1: p = 1.5 - 0.5 * 2.
        assert!((values(&qs[0])[0] - 0.61).abs() < 1e-12);
        assert_eq!(values(&qs[1]), [0.5]);
        assert_eq!((values(&ps[0]), values(&ps[1])), (values(&qs[0]), values(&qs[1])));
    }

    /// The state dict through a safetensors file's bytes, as `ember train` checkpoints it.
    fn through_file(state: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let bytes = crate::state_dict::save_tensors_to_bytes(state).unwrap();
        crate::state_dict::load_tensors_from_bytes(&bytes, Device::Cpu).unwrap()
    }

    fn by_key(state: &[(String, Tensor)]) -> Vec<(String, Vec<usize>, Vec<f64>)> {
        let mut out: Vec<_> = state
            .iter()
            .map(|(k, t)| (k.clone(), t.dims().to_vec(), values(t)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn adamw_two_groups(ps: &[Tensor], defaults: AdamConfig, group1: ParamGroup) -> AdamW {
        AdamW::with_groups(
            vec![
                ParamGroup::new(ps[..2].to_vec()),
                group1.with_params(ps[2..].to_vec()),
            ],
            defaults,
        )
        .unwrap()
    }

    /// Steps `opt` over `ps` with gradients of step `t` (the same for every optimizer).
    fn step_at(opt: &mut dyn Optimizer, ps: &[Tensor], t: usize) {
        for (i, p) in ps.iter().enumerate() {
            let g: Vec<f64> = (0..p.numel())
                .map(|j| ((t * 7 + i * 3 + j) as f64).sin())
                .collect();
            set_grad(p, &g);
        }
        opt.step().unwrap();
    }

    #[test]
    fn every_group_hyperparameter_round_trips() {
        // AdamW of two groups that differ in lr, betas, weight decay and eps, amsgrad and
        // fused=False, two steps and a scheduler; loaded (through a file) into an AdamW built
        // with other values everywhere, maximize and fused included: the loaded groups are the
        // saved ones, and the next steps give the same bits.
        let original = AdamConfig {
            lr: 0.01,
            betas: (0.85, 0.995),
            eps: 1e-6,
            weight_decay: 0.1,
            amsgrad: true,
            maximize: false,
            fused: Some(false),
        };
        let group1 = ParamGroup::new(vec![])
            .lr(0.03)
            .betas((0.7, 0.9))
            .weight_decay(0.0)
            .eps(1e-4);
        let other = AdamConfig {
            lr: 0.5,
            betas: (0.5, 0.6),
            eps: 1e-2,
            weight_decay: 0.3,
            amsgrad: false,
            maximize: true,
            fused: None,
        };
        let ps = [param(&[1.0, -1.0]), param(&[0.5]), param(&[2.0, 0.0, -3.0])];
        let qs: Vec<Tensor> = ps.iter().map(|p| param(&values(p))).collect();
        let mut a = adamw_two_groups(&ps, original, group1.clone());
        let mut sched = StepLR::new(&mut a, 1, 0.5).unwrap();
        for t in 0..2 {
            step_at(&mut a, &ps, t);
            sched.step(&mut a);
        }
        let state = a.state_dict();
        assert_eq!(
            entry(&state, "param_groups.1.betas").to_vec::<f64>().unwrap(),
            [0.7, 0.9]
        );
        assert_eq!(entry(&state, "param_groups.1.eps").item_f64().unwrap(), 1e-4);
        assert_eq!(
            entry(&state, "param_groups.0.weight_decay").item_f64().unwrap(),
            0.1
        );
        assert_eq!(
            entry(&state, "param_groups.1.amsgrad").to_vec::<bool>().unwrap(),
            [true]
        );
        assert_eq!(
            entry(&state, "param_groups.1.fused").to_vec::<bool>().unwrap(),
            [false]
        );
        let mut b = adamw_two_groups(&qs, other, ParamGroup::new(vec![]).lr(0.7).eps(0.5));
        {
            let _g = ember_core::no_grad();
            for (p, q) in ps.iter().zip(&qs) {
                q.copy_(p).unwrap();
            }
        }
        b.load_state_dict(&through_file(&state)).unwrap();
        for g in 0..2 {
            let (x, y) = (&a.param_groups()[g], &b.param_groups()[g]);
            assert_eq!(x.config(), y.config(), "group {g}");
            assert_eq!(x.initial_lr(), y.initial_lr(), "group {g}");
        }
        assert_eq!(b.param_groups()[1].config().betas, (0.7, 0.9));
        assert_eq!(b.param_groups()[1].config().lr, 0.03 / 4.0);
        assert_eq!(
            b.defaults(),
            other,
            "defaults are the optimizer's own, as PyTorch's"
        );
        for t in 2..4 {
            step_at(&mut a, &ps, t);
            step_at(&mut b, &qs, t);
        }
        for (p, q) in ps.iter().zip(&qs) {
            assert_eq!(values(p), values(q));
        }
        assert_eq!(by_key(&a.state_dict()), by_key(&b.state_dict()));

        // fused=None (PyTorch's None: an empty bool tensor) replaces a built Some(false).
        let unset = AdamConfig {
            fused: None,
            ..original
        };
        let a = adamw_two_groups(&ps, unset, group1);
        let state = through_file(&a.state_dict());
        assert_eq!(entry(&state, "param_groups.0.fused").dims(), [0]);
        let mut b = adamw_two_groups(&qs, original, ParamGroup::new(vec![]));
        b.load_state_dict(&state).unwrap();
        assert_eq!(b.param_groups()[0].config().fused, None);
        assert_eq!(b.param_groups()[1].config(), a.param_groups()[1].config());
    }

    #[test]
    fn every_sgd_group_hyperparameter_round_trips() {
        // Two SGD groups: Nesterov momentum with decay, and dampened momentum at another lr;
        // loaded into an SGD of plain groups, they step as the original.
        let make = |ps: &[Tensor], groups: [ParamGroup; 2], defaults: SgdConfig| {
            SGD::with_groups(
                vec![
                    groups[0].with_params(vec![ps[0].clone()]),
                    groups[1].with_params(ps[1..].to_vec()),
                ],
                defaults,
            )
            .unwrap()
        };
        let defaults = SgdConfig {
            lr: 0.1,
            maximize: true,
            ..Default::default()
        };
        let groups = [
            ParamGroup::new(vec![])
                .momentum(0.9)
                .nesterov(true)
                .weight_decay(0.01),
            ParamGroup::new(vec![]).lr(0.05).momentum(0.5).dampening(0.2),
        ];
        let ps = [param(&[1.0, 2.0]), param(&[-1.0]), param(&[0.5, 0.25])];
        let qs: Vec<Tensor> = ps.iter().map(|p| param(&values(p))).collect();
        let mut a = make(&ps, groups, defaults);
        for t in 0..2 {
            step_at(&mut a, &ps, t);
        }
        let plain = [ParamGroup::new(vec![]), ParamGroup::new(vec![])];
        let mut b = make(&qs, plain, SgdConfig::default());
        {
            let _g = ember_core::no_grad();
            for (p, q) in ps.iter().zip(&qs) {
                q.copy_(p).unwrap();
            }
        }
        b.load_state_dict(&through_file(&a.state_dict())).unwrap();
        for g in 0..2 {
            assert_eq!(
                a.param_groups()[g].config(),
                b.param_groups()[g].config(),
                "group {g}"
            );
        }
        assert!(b.param_groups()[0].config().nesterov && b.param_groups()[1].config().maximize);
        for t in 2..4 {
            step_at(&mut a, &ps, t);
            step_at(&mut b, &qs, t);
        }
        for (p, q) in ps.iter().zip(&qs) {
            assert_eq!(values(p), values(q));
        }
    }

    #[test]
    fn state_dicts_without_the_hyperparameters_keep_the_groups_values() {
        // What ember wrote before the groups kept every hyperparameter: `params`, `lr` and
        // `initial_lr` (and before groups, not even `params`). The loaded lr replaces the
        // group's; everything else stays as the optimizer was built.
        let ps = [param(&[1.0, -1.0]), param(&[0.5]), param(&[2.0, 0.0, -3.0])];
        let built = AdamConfig {
            lr: 0.2,
            betas: (0.8, 0.9),
            eps: 1e-3,
            weight_decay: 0.05,
            amsgrad: false,
            maximize: false,
            fused: Some(false),
        };
        let mut a = adamw_two_groups(&ps, AdamConfig::adamw(), ParamGroup::new(vec![]).lr(0.02));
        let _sched = StepLR::new(&mut a, 1, 0.5).unwrap();
        step_at(&mut a, &ps, 0);
        let old = |keep_params: bool| -> Vec<(String, Tensor)> {
            a.state_dict()
                .into_iter()
                .filter(|(k, _)| {
                    !k.starts_with("param_groups.")
                        || k.ends_with(".lr")
                        || k.ends_with(".initial_lr")
                        || (keep_params && k.ends_with(".params"))
                })
                .collect()
        };
        for keep_params in [true, false] {
            let mut b = adamw_two_groups(&ps, built, ParamGroup::new(vec![]).eps(1e-5));
            b.load_state_dict(&old(keep_params)).unwrap();
            assert_eq!(b.param_groups()[0].config(), &AdamConfig { lr: 1e-3, ..built });
            assert_eq!(
                b.param_groups()[1].config(),
                &AdamConfig {
                    lr: 0.02,
                    eps: 1e-5,
                    ..built
                }
            );
            assert_eq!(b.group_initial_lr(1), Some(0.02));
            assert_eq!(entry(&b.state_dict(), "state.2.step").item_f64().unwrap(), 1.0);
        }
        // An SGD state dict of `lr` only (one group, before groups existed).
        let mut sgd = SGD::new(
            vec![param(&[1.0])],
            SgdConfig {
                momentum: 0.9,
                nesterov: true,
                ..Default::default()
            },
        )
        .unwrap();
        let lr = Tensor::scalar(0.25, DType::F64, Device::Cpu).unwrap();
        sgd.load_state_dict(&[("param_groups.0.lr".to_string(), lr)])
            .unwrap();
        assert_eq!(
            (sgd.config().lr, sgd.config().momentum, sgd.config().nesterov),
            (0.25, 0.9, true)
        );
    }

    #[test]
    fn bad_group_hyperparameters_are_typed_errors() {
        let ps = [param(&[1.0, -1.0]), param(&[0.5]), param(&[2.0])];
        let mut a = adamw_two_groups(&ps, AdamConfig::adamw(), ParamGroup::new(vec![]).lr(0.02));
        step_at(&mut a, &ps, 0);
        let good = a.state_dict();
        let with = |key: &str, t: Tensor| -> Vec<(String, Tensor)> {
            let mut s = good.clone();
            match s.iter().position(|(k, _)| k == key) {
                Some(at) => s[at].1 = t,
                None => s.push((key.to_string(), t)),
            }
            s
        };
        let f64s = |v: &[f64]| Tensor::from_slice(v, [v.len()], Device::Cpu).unwrap();
        let scalar = |v: f64| Tensor::scalar(v, DType::F64, Device::Cpu).unwrap();
        let cases = [
            // Three betas; eps as a bool; amsgrad as a number; a beta of 1 (what Adam's
            // constructor refuses); SGD's momentum in an AdamW state dict.
            (with("param_groups.1.betas", f64s(&[0.9, 0.99, 0.5])), "betas"),
            (
                with(
                    "param_groups.0.eps",
                    Tensor::from_vec(vec![true], [], Device::Cpu).unwrap(),
                ),
                "0-d floating-point",
            ),
            (with("param_groups.0.amsgrad", scalar(1.0)), "0-d bool"),
            (with("param_groups.1.betas", f64s(&[1.0, 0.9])), "param group 1"),
            (
                with("param_groups.1.momentum", scalar(0.9)),
                "param_groups.1.momentum",
            ),
        ];
        let mut b = adamw_two_groups(&ps, AdamConfig::adamw(), ParamGroup::new(vec![]).lr(0.02));
        for (state, says) in cases {
            let e = b.load_state_dict(&state).unwrap_err();
            assert!(
                matches!(e, StateDictError::Tensor(Error::InvalidArgument { .. })),
                "{e}"
            );
            assert!(e.to_string().contains(says), "{e} (expected {says:?})");
        }
        // Nothing changed: the groups are as built, and no state was loaded.
        assert_eq!(b.param_groups()[1].config().betas, (0.9, 0.999));
        assert_eq!(b.state_dict().len(), good.len() - 9);
        b.load_state_dict(&good).unwrap();
        assert_eq!(by_key(&b.state_dict()), by_key(&good));
    }

    #[test]
    fn mismatched_state_dicts_are_refused() {
        let two = |sizes: [usize; 2]| {
            let ps: Vec<Tensor> = (0..sizes[0] + sizes[1]).map(|i| param(&[i as f64])).collect();
            let (x, y) = ps.split_at(sizes[0]);
            let mut opt = AdamW::with_groups(
                vec![
                    ParamGroup::new(x.to_vec()),
                    ParamGroup::new(y.to_vec()).weight_decay(0.0),
                ],
                AdamConfig::adamw(),
            )
            .unwrap();
            for p in &ps {
                set_grad(p, &[1.0]);
            }
            opt.step().unwrap();
            opt
        };
        let one = || {
            let ps: Vec<Tensor> = (0..3).map(|i| param(&[i as f64])).collect();
            let mut opt = AdamW::new(ps.clone(), AdamConfig::adamw()).unwrap();
            for p in &ps {
                set_grad(p, &[1.0]);
            }
            opt.step().unwrap();
            opt
        };
        // Two groups into one: the count.
        let e = one().load_state_dict(&two([2, 1]).state_dict()).unwrap_err();
        assert!(
            matches!(
                e,
                StateDictError::ParamGroupCount {
                    expected: 1,
                    found: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("same groups in the same order"), "{e}");
        // One group into two, also without the `params` entries of state dicts from before
        // groups existed.
        let old: Vec<(String, Tensor)> = one()
            .state_dict()
            .into_iter()
            .filter(|(k, _)| k != "param_groups.0.params")
            .collect();
        for state in [one().state_dict(), old.clone()] {
            let e = two([2, 1]).load_state_dict(&state).unwrap_err();
            assert!(
                matches!(
                    e,
                    StateDictError::ParamGroupCount {
                        expected: 2,
                        found: 1,
                        ..
                    }
                ),
                "{e}"
            );
        }
        // Groups of other sizes, the same count and total.
        let mut target = two([1, 2]);
        target.set_lr(0.5);
        let e = target.load_state_dict(&two([2, 1]).state_dict()).unwrap_err();
        assert!(
            matches!(
                e,
                StateDictError::ParamGroupSize {
                    group: 0,
                    expected: 1,
                    found: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("same order"), "{e}");
        // A failed load leaves the optimizer as it was.
        assert_eq!(target.group_lrs(), [0.5, 0.5]);
        // Through ember_core's error (`?` in a function returning ember_core::Result).
        let core: Error = e.into();
        assert!(core.to_string().contains("parameter group"), "{core}");
        // A one-group state dict from before groups existed still loads.
        let mut again = one();
        again.load_state_dict(&old).unwrap();
        assert_eq!(again.state_dict().len(), old.len() + 1);
        // Bad `params` entries.
        let mut state = two([2, 1]).state_dict();
        let at = state
            .iter()
            .position(|(k, _)| k == "param_groups.1.params")
            .unwrap();
        state[at].1 = Tensor::from_vec(vec![7i64], [1], Device::Cpu).unwrap();
        assert!(two([2, 1]).load_state_dict(&state).is_err());
        state[at].1 = Tensor::from_vec(vec![2.0f32], [1], Device::Cpu).unwrap();
        assert!(two([2, 1]).load_state_dict(&state).is_err());
        let mut sgd = SGD::new(vec![param(&[1.0])], SgdConfig::default()).unwrap();
        let e = sgd.load_state_dict(&two([2, 1]).state_dict()).unwrap_err();
        assert!(matches!(e, StateDictError::ParamGroupCount { .. }), "{e}");
    }

    #[test]
    fn schedulers_scale_every_group_from_its_own_initial_lr() {
        let close = |got: &[f64], want: &[f64], what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-14 * (1.0 + w.abs()),
                    "{what}: got {got:?}, want {want:?}"
                );
            }
        };
        // StepLR(2, 0.5): lr_g = base_g * 0.5^(e / 2).
        let mut opt = sgd_groups([1.0, 0.1]);
        let mut s = StepLR::new(&mut opt, 2, 0.5).unwrap();
        assert_eq!(
            (opt.group_initial_lr(0), opt.group_initial_lr(1)),
            (Some(1.0), Some(0.1))
        );
        for e in 0..8 {
            if e > 0 {
                s.step(&mut opt);
            }
            let f = 0.5f64.powi(e / 2);
            close(&s.get_last_lrs(), &[f, 0.1 * f], &format!("StepLR epoch {e}"));
            close(&opt.group_lrs(), &[f, 0.1 * f], &format!("StepLR epoch {e}"));
            assert_eq!(s.get_last_lr(), opt.lr());
        }
        // Cosine with eta_min: each group anneals from its own base to eta_min.
        let (eta_min, t_max) = (0.01, 4);
        let mut opt = sgd_groups([1.0, 0.1]);
        let mut s = CosineAnnealingLR::new(&mut opt, t_max, eta_min).unwrap();
        for e in 0..10 {
            if e > 0 {
                s.step(&mut opt);
            }
            let c = (1.0 + (std::f64::consts::PI * e as f64 / t_max as f64).cos()) / 2.0;
            let want = [eta_min + (1.0 - eta_min) * c, eta_min + (0.1 - eta_min) * c];
            close(&opt.group_lrs(), &want, &format!("cosine epoch {e}"));
        }
        // nanoGPT's shape: linear warm-up, then cosine, each group from its own base.
        let mut opt = sgd_groups([1.0, 0.1]);
        let warm = LinearLR::new(&mut opt, 0.1, 1.0, 2).unwrap();
        let cos = CosineAnnealingLR::new(&mut opt, 5, 0.0).unwrap();
        let mut s = SequentialLR::new(&mut opt, vec![Box::new(warm), Box::new(cos)], vec![3]).unwrap();
        for e in 0..9i64 {
            if e > 0 {
                s.step(&mut opt);
            }
            let f = if e < 3 {
                0.1 + 0.9 * e.min(2) as f64 / 2.0
            } else {
                (1.0 + (std::f64::consts::PI * (e - 3) as f64 / 5.0).cos()) / 2.0
            };
            close(&s.get_last_lrs(), &[f, 0.1 * f], &format!("sequential epoch {e}"));
            close(&opt.group_lrs(), &[f, 0.1 * f], &format!("sequential epoch {e}"));
        }
        // A group added after the scheduler was built keeps its lr.
        let mut opt = sgd_groups([1.0, 0.1]);
        let mut s = StepLR::new(&mut opt, 1, 0.5).unwrap();
        opt.add_param_group(ParamGroup::new(vec![param(&[0.0])]).lr(3.0))
            .unwrap();
        s.step(&mut opt);
        close(&opt.group_lrs(), &[0.5, 0.05, 3.0], "added group");
    }

    #[test]
    fn scheduled_groups_update_with_their_own_lr() {
        // SGD, groups lr 1 and 0.1, StepLR(1, 0.5), gradient 1 twice:
        // a = 1 - 1 - 0.5 = -0.5; b = 2 - 0.1 - 0.05 = 1.85.
        let (a, b) = (param(&[1.0]), param(&[2.0]));
        let mut opt = SGD::with_groups(
            vec![
                ParamGroup::new(vec![a.clone()]),
                ParamGroup::new(vec![b.clone()]).lr(0.1),
            ],
            SgdConfig {
                lr: 1.0,
                ..Default::default()
            },
        )
        .unwrap();
        let mut s = StepLR::new(&mut opt, 1, 0.5).unwrap();
        for _ in 0..2 {
            set_grad(&a, &[1.0]);
            set_grad(&b, &[1.0]);
            opt.step().unwrap();
            s.step(&mut opt);
        }
        assert_eq!(values(&a), [-0.5]);
        assert!((values(&b)[0] - 1.85).abs() < 1e-15);
    }
}
