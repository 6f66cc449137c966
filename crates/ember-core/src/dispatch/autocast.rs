//! Step 2 of the dispatch point: an op's autocast policy applied to its inputs while an
//! autocast region is open for their device type (see [`crate::amp`], the user's API over the
//! per-thread state kept here, with the cast cache of Note [Autocast cast cache] in `amp.rs`).
//! Only floating tensors that are not float64 are cast, as in PyTorch
//! (`is_autocast_eligible`).

use super::policy::{CastPolicy, Op};
use super::tensor_impl::{Tensor, TensorImpl};
use crate::device::DeviceType;
use crate::{DType, Device, Result};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

fn eligible(t: &Tensor) -> bool {
    t.dtype().is_floating_point() && t.dtype() != DType::F64
}

/// Casts `inputs` of `op` on `device` as its policy says, when autocast is on there.
#[inline]
pub(crate) fn apply(op: &Op, device: Device, inputs: &mut [Tensor]) -> Result<()> {
    if op.autocast == CastPolicy::Inputs {
        return Ok(());
    }
    let Some(lower) = active_dtype(device.device_type()) else {
        return Ok(());
    };
    let target = match op.autocast {
        CastPolicy::Inputs => return Ok(()),
        CastPolicy::LowerPrecision => lower,
        CastPolicy::Fp32 => DType::F32,
        // PyTorch's `promote_type`: the lower-precision dtype promoted with every eligible input.
        CastPolicy::Promote => inputs
            .iter()
            .filter(|t| eligible(t))
            .fold(lower, |d, t| d.promote(t.dtype())),
    };
    for t in inputs.iter_mut() {
        if eligible(t) && t.dtype() != target {
            *t = if op.autocast == CastPolicy::LowerPrecision {
                cached_cast(t, target)?
            } else {
                t.to_dtype_preserving_strides(target)?
            };
        }
    }
    Ok(())
}

/// Autocast settings of one device type on one thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceState {
    pub(crate) enabled: bool,
    pub(crate) dtype: DType,
}

/// The thread's autocast state: per device type, plus the region nesting depth (for the cast
/// cache) and whether a composite op suspended autocast for its body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct State {
    cuda: DeviceState,
    cpu: DeviceState,
    pub(crate) cache_enabled: bool,
    pub(crate) nesting: u32,
    suspended: bool,
}

impl State {
    const DEFAULT: State = State {
        cuda: DeviceState {
            enabled: false,
            dtype: DType::F16,
        },
        cpu: DeviceState {
            enabled: false,
            dtype: DType::BF16,
        },
        cache_enabled: true,
        nesting: 0,
        suspended: false,
    };

    pub(crate) fn device(&mut self, device_type: DeviceType) -> &mut DeviceState {
        match device_type {
            DeviceType::Cuda => &mut self.cuda,
            DeviceType::Cpu => &mut self.cpu,
        }
    }
}

/// A cast made inside an autocast region: the source (kept alive so its address stays its
/// own) and the cast tensor.
type CacheEntry = (Arc<TensorImpl>, Tensor);

thread_local! {
    static STATE: Cell<State> = const { Cell::new(State::DEFAULT) };
    static CACHE: RefCell<HashMap<(usize, DType), CacheEntry>> = RefCell::new(HashMap::new());
}

pub(crate) fn state() -> State {
    STATE.with(Cell::get)
}

pub(crate) fn update(f: impl FnOnce(&mut State)) {
    STATE.with(|s| {
        let mut st = s.get();
        f(&mut st);
        s.set(st);
    })
}

/// The dtype `device_type`'s autocast region casts to, when one is open on this thread and no
/// composite op has suspended it (the dispatch point's fast check).
#[inline]
pub(crate) fn active_dtype(device_type: DeviceType) -> Option<DType> {
    let s = state();
    let d = match device_type {
        DeviceType::Cuda => s.cuda,
        DeviceType::Cpu => s.cpu,
    };
    (d.enabled && !s.suspended).then_some(d.dtype)
}

/// Empties this thread's cast cache (`amp::clear_autocast_cache`).
pub(crate) fn clear_cache() {
    CACHE.with(|c| c.borrow_mut().clear());
}

/// Number of entries in this thread's cast cache.
pub(crate) fn cache_len() -> usize {
    CACHE.with(|c| c.borrow().len())
}

/// Suspends autocast on this thread until the guard drops (the body of a composite op).
pub(crate) struct Suspended {
    previous: bool,
    _not_send: PhantomData<*const ()>,
}

impl Drop for Suspended {
    fn drop(&mut self) {
        let previous = self.previous;
        update(|s| s.suspended = previous);
    }
}

pub(crate) fn suspend() -> Suspended {
    let mut previous = false;
    update(|s| {
        previous = s.suspended;
        s.suspended = true;
    });
    Suspended {
        previous,
        _not_send: PhantomData,
    }
}

/// `t` cast to `dtype` for an op in an autocast region, through the cast cache where Note
/// [Autocast cast cache] allows it.
pub(crate) fn cached_cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let cacheable = state().cache_enabled && t.dtype() == DType::F32 && t.is_leaf() && t.requires_grad();
    if !cacheable {
        return t.to_dtype_preserving_strides(dtype);
    }
    let key = (Arc::as_ptr(&t.0) as usize, dtype);
    if let Some(hit) = CACHE.with(|c| c.borrow().get(&key).map(|(_, cast)| cast.clone())) {
        return Ok(hit);
    }
    let cast = t.to_dtype_preserving_strides(dtype)?;
    CACHE.with(|c| c.borrow_mut().insert(key, (t.0.clone(), cast.clone())));
    Ok(cast)
}
