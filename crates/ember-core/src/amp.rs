//! Automatic mixed precision (`torch.amp`): [`autocast`] regions in which ops listed in the
//! dispatch point's policy table ([`crate::dispatch::policy`]) run in float16 or bfloat16, or
//! in float32, whatever dtypes their inputs have.
//!
//! Autocast state is per thread and per device type, as in PyTorch: a region opened on one
//! thread does not change ops on another, and CUDA and CPU autocast are independent. Regions
//! nest; an inner region with `enabled(false)` turns autocast off until it closes. Defaults
//! are PyTorch's: float16 on CUDA, bfloat16 on the CPU.
//!
//! Note [Autocast cast cache]: inside the outermost region, a float32 leaf tensor that
//! requires grad (a parameter) cast to the lower-precision dtype is cast once and the cast is
//! reused by every later op of the region (a weight shared by several matmuls, or used in every
//! step of a recurrence, is cast once per region). The cache holds the source tensor too, so
//! an entry's key (the tensor's address) stays unique while the entry lives; it is emptied
//! when the outermost region closes. Regions opened with `cache_enabled(false)` neither read
//! nor fill it. (PyTorch: `aten/src/ATen/autocast_mode.cpp`, `cached_casts`.)
//!
//! ```
//! use ember_core::{amp, DType, Device, DeviceType, Tensor};
//! let a = Tensor::ones([2, 3], DType::F32, Device::Cpu)?;
//! let b = Tensor::ones([3, 4], DType::F32, Device::Cpu)?;
//! {
//!     let _ac = amp::autocast(DeviceType::Cpu, DType::BF16)?;
//!     assert_eq!(a.matmul(&b)?.dtype(), DType::BF16); // lower precision
//!     assert_eq!(a.exp()?.dtype(), DType::F32);       // float32 policy
//!     {
//!         let _off = amp::Autocast::new(DeviceType::Cpu).enabled(false).enter()?;
//!         assert_eq!(a.matmul(&b)?.dtype(), DType::F32);
//!     }
//! }
//! assert_eq!(a.matmul(&b)?.dtype(), DType::F32);
//! # Ok::<(), ember_core::Error>(())
//! ```

use crate::device::DeviceType;
use crate::tensor::TensorImpl;
use crate::{DType, Error, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

/// Autocast settings of one device type on one thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DeviceState {
    enabled: bool,
    dtype: DType,
}

/// The thread's autocast state: per device type, plus the region nesting depth (for the cast
/// cache) and whether a composite op suspended autocast for its body.
#[derive(Debug, Clone, Copy)]
struct State {
    cuda: DeviceState,
    cpu: DeviceState,
    cache_enabled: bool,
    nesting: u32,
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

    fn device(&mut self, device_type: DeviceType) -> &mut DeviceState {
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

fn state() -> State {
    STATE.with(Cell::get)
}

fn update(f: impl FnOnce(&mut State)) {
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

/// Whether autocast is on for `device_type` on this thread (`torch.is_autocast_enabled`).
pub fn is_autocast_enabled(device_type: DeviceType) -> bool {
    let mut s = state();
    s.device(device_type).enabled
}

/// The dtype `device_type`'s autocast casts to (`torch.get_autocast_dtype`); float16 for CUDA
/// and bfloat16 for the CPU unless a region chose another.
pub fn get_autocast_dtype(device_type: DeviceType) -> DType {
    let mut s = state();
    s.device(device_type).dtype
}

/// Whether regions on this thread use the cast cache (`torch.is_autocast_cache_enabled`).
pub fn is_autocast_cache_enabled() -> bool {
    state().cache_enabled
}

/// Empties this thread's cast cache (`torch.clear_autocast_cache`); closing the outermost
/// region does it too.
pub fn clear_autocast_cache() {
    CACHE.with(|c| c.borrow_mut().clear());
}

/// The dtypes autocast can cast to on `device_type`.
fn supported(device_type: DeviceType, dtype: DType) -> bool {
    match device_type {
        DeviceType::Cuda | DeviceType::Cpu => matches!(dtype, DType::F16 | DType::BF16),
    }
}

/// Options of an autocast region (`torch.autocast(device_type, dtype, enabled, cache_enabled)`);
/// [`Autocast::enter`] opens it.
#[derive(Debug, Clone, Copy)]
pub struct Autocast {
    device_type: DeviceType,
    dtype: Option<DType>,
    enabled: bool,
    cache_enabled: Option<bool>,
}

impl Autocast {
    /// An enabled region for `device_type` with its current dtype (by default float16 on CUDA,
    /// bfloat16 on the CPU).
    pub fn new(device_type: DeviceType) -> Autocast {
        Autocast {
            device_type,
            dtype: None,
            enabled: true,
            cache_enabled: None,
        }
    }

    /// The lower-precision dtype: float16 or bfloat16.
    pub fn dtype(mut self, dtype: DType) -> Autocast {
        self.dtype = Some(dtype);
        self
    }

    /// `false` opens a region in which autocast is off (inside another region, too).
    pub fn enabled(mut self, enabled: bool) -> Autocast {
        self.enabled = enabled;
        self
    }

    /// Whether the region uses the cast cache (see Note [Autocast cast cache]); inherits the
    /// enclosing setting when not given (true outside any region).
    pub fn cache_enabled(mut self, cache_enabled: bool) -> Autocast {
        self.cache_enabled = Some(cache_enabled);
        self
    }

    /// Opens the region on this thread until the guard drops.
    pub fn enter(self) -> Result<AutocastGuard> {
        let mut previous = state();
        let mut next = previous;
        let dtype = self.dtype.unwrap_or(next.device(self.device_type).dtype);
        if self.enabled && !supported(self.device_type, dtype) {
            return Err(Error::invalid(
                "autocast",
                format!(
                    "{} autocast casts to float16 or bfloat16, not {dtype}; pass DType::F16 or DType::BF16",
                    self.device_type
                ),
            ));
        }
        *next.device(self.device_type) = DeviceState {
            enabled: self.enabled,
            dtype,
        };
        if let Some(c) = self.cache_enabled {
            next.cache_enabled = c;
        }
        next.nesting += 1;
        STATE.with(|s| s.set(next));
        Ok(AutocastGuard {
            device_type: self.device_type,
            previous: *previous.device(self.device_type),
            previous_cache: previous.cache_enabled,
            _not_send: PhantomData,
        })
    }
}

/// Opens an autocast region for `device_type` casting to `dtype` until the returned guard
/// drops (`with torch.autocast(device_type, dtype=dtype):`).
pub fn autocast(device_type: DeviceType, dtype: DType) -> Result<AutocastGuard> {
    Autocast::new(device_type).dtype(dtype).enter()
}

/// An open autocast region; dropping it restores the enclosing settings, and closing the
/// outermost region empties the cast cache.
#[must_use = "the autocast region closes when the guard is dropped"]
pub struct AutocastGuard {
    device_type: DeviceType,
    previous: DeviceState,
    previous_cache: bool,
    // The state is thread-local: the guard must drop on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let mut outermost = false;
        update(|s| {
            *s.device(self.device_type) = self.previous;
            s.cache_enabled = self.previous_cache;
            s.nesting = s.nesting.saturating_sub(1);
            outermost = s.nesting == 0;
        });
        if outermost {
            clear_autocast_cache();
        }
    }
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

/// Number of entries in this thread's cast cache (for tests of Note [Autocast cast cache]).
pub fn autocast_cache_len() -> usize {
    CACHE.with(|c| c.borrow().len())
}
