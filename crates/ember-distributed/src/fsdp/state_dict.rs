//! The sharded state dicts of FSDP models and their optimizers (Note [FSDP state dicts]):
//! the registry of live units, [`get_model_state_dict`] and [`get_optimizer_state_dict`].

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use ember_core::{Result, Tensor};
use ember_nn::optim::Optimizer;
use ember_nn::{Module, TensorKind};

use super::{index_of, FsdpState};
use crate::checkpoint::StateValue;
use crate::dtensor::DTensor;

/// A live sharded unit as the state-dict functions see it (Note [FSDP state dicts]).
pub(super) trait Unit: Send + Sync {
    /// The [`DTensor`] of `t` when `t` is one of this unit's shards.
    fn dtensor_of(&self, t: &Tensor) -> Option<Result<DTensor>>;
}

/// Every [`FSDPModule`] made and not yet dropped (Note [FSDP state dicts]).
static UNITS: Mutex<Vec<Weak<dyn Unit>>> = Mutex::new(Vec::new());

fn units() -> MutexGuard<'static, Vec<Weak<dyn Unit>>> {
    UNITS.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn register(unit: Weak<dyn Unit>) {
    let mut all = units();
    all.retain(|u| u.strong_count() > 0);
    all.push(unit);
}

/// The [`DTensor`] of `t` if a live unit shards it.
pub(super) fn find_dtensor(t: &Tensor) -> Option<Result<DTensor>> {
    let live: Vec<Arc<dyn Unit>> = units().iter().filter_map(Weak::upgrade).collect();
    live.iter().find_map(|u| u.dtensor_of(t))
}

impl<M: Send> Unit for FsdpState<M> {
    fn dtensor_of(&self, t: &Tensor) -> Option<Result<DTensor>> {
        let shards = self.shards();
        let i = index_of(&shards, t)?;
        Some(self.dtensor(i, &shards[i]))
    }
}

/// The state dict of `model` for [`crate::dcp::save`] and [`crate::dcp::load`]
/// (`get_model_state_dict(model)`, Note [FSDP state dicts]): every tensor under its dotted
/// name, as [`ember_nn::ModuleExt::state_dict`] lists them, the shards of [`super::FSDPModule`]s
/// (nested ones included) as [`DTensor`]s, the rest as plain tensors. The tensors are the
/// model's own, so `dcp::load` writes into the model.
pub fn get_model_state_dict<M: Module + ?Sized>(model: &M) -> Result<Vec<(String, StateValue)>> {
    let mut out = Vec::new();
    let mut failed = None;
    model.visit("", &mut |name, t, kind| {
        let value = match find_dtensor(t).filter(|_| kind == TensorKind::Parameter) {
            Some(Ok(d)) => StateValue::DTensor(d),
            Some(Err(e)) => {
                failed.get_or_insert(e);
                return;
            }
            None => StateValue::Tensor(t.detach()),
        };
        out.push((name.to_owned(), value));
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// The state dict of an optimizer over FSDP shards for [`crate::dcp::save`] and
/// [`crate::dcp::load`] (`get_optimizer_state_dict`, Note [FSDP state dicts]): the
/// optimizer's state dict (Note [State dict format] of `ember_nn::optim`) with each
/// per-parameter state tensor of a sharded parameter (`exp_avg`, `momentum_buffer`, ...) a
/// [`DTensor`] laid out as that parameter; step counts, param groups and the state of
/// unsharded parameters stay plain. After `dcp::load`, hand the loaded values to the optimizer
/// with `optim.load_state_dict(&dcp::to_local_state(&state))` (some entries, as Adam's device
/// step count, are copies).
pub fn get_optimizer_state_dict(optim: &dyn Optimizer) -> Result<Vec<(String, StateValue)>> {
    let params: Vec<Option<DTensor>> = optim
        .params()
        .iter()
        .map(|p| find_dtensor(p).transpose())
        .collect::<Result<_>>()?;
    optim
        .state_dict()
        .into_iter()
        .map(|(key, t)| {
            let param = key
                .strip_prefix("state.")
                .and_then(|rest| rest.split_once('.'))
                .filter(|(_, name)| *name != "step")
                .and_then(|(i, _)| i.parse::<usize>().ok())
                .and_then(|i| params.get(i)?.as_ref());
            match param {
                Some(p) if t.shape() == p.local_tensor().shape() => {
                    let d = DTensor::from_local(t, p.device_mesh(), p.placements(), Some(p.shape().clone()))?;
                    Ok((key, StateValue::DTensor(d)))
                }
                _ => Ok((key, StateValue::Tensor(t))),
            }
        })
        .collect()
}
