//! Automatic mixed precision (`torch.amp`): [`autocast()`] regions in which ops listed in the
//! dispatch point's policy table ([`crate::dispatch::policy`]) run in float16 or bfloat16, or
//! in float32, whatever dtypes their inputs have.
//!
//! The state (per thread, per device type) and the cast cache live with the dispatch point that
//! reads them (`dispatch/autocast.rs`, as PyTorch keeps them beside its Autocast dispatch key);
//! this module is the user's API over them. Autocast state is per thread and per device type,
//! as in PyTorch: a region opened on one
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

#![deny(unsafe_code)]

use crate::device::DeviceType;
use crate::dispatch::autocast::{self, state, update, DeviceState};
use crate::{DType, Error, Result};
use std::marker::PhantomData;

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
    autocast::clear_cache();
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
        update(|s| *s = next);
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

/// Number of entries in this thread's cast cache (for tests of Note [Autocast cast cache]).
pub fn autocast_cache_len() -> usize {
    autocast::cache_len()
}
