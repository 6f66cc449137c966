//! ember: a deep-learning framework in Rust with first-class NVIDIA GPU support.
//!
//! This facade re-exports the layers below it so that a program needs one dependency:
//! tensors and autograd from `ember-core`, layers and optimizers from `ember-nn`, data loading
//! from `ember-data`, multi-GPU training from `ember-distributed`.
//! Coming from PyTorch: [`coming_from_pytorch`] maps torch's names to ember's;
//! `use ember::prelude::*` brings the common names in one import ([`prelude`]).
//!
//! ```
//! use ember::{DType, Device, Tensor};
//! # fn main() -> ember::Result<()> {
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], Device::Cpu)?;
//! let b = a.add_scalar(1.0)?.mul(&a)?;
//! assert_eq!(b.to_vec::<f32>()?, vec![2.0, 6.0, 12.0, 20.0]);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

/// `torch.tensor(data)`: a CPU tensor of a literal (`tensor!([[1.0, 2.0], [3.0, 4.0]])`).
pub use ember_core::tensor;
pub use ember_core::{
    autograd, backends, default_generator, dispatch, enable_grad, get_num_threads, get_rng_state,
    initial_seed, is_grad_enabled, manual_seed, no_grad, seed, set_grad_enabled, set_num_threads,
    set_rng_state, DType, Device, DeviceType, Element, Error, Generator, Result, RngState, Scalar, Shape,
    Sizes, Tensor,
};
/// `torch.optim` (also `ember::nn::optim`).
pub use ember_nn::optim;
pub mod cuda;
pub mod prelude;
/// Python's pickle format for plain data ([`pickle::Value`]): what [`cuda::snapshot`] returns
/// and [`cuda::dump_snapshot`] writes, readable by PyTorch's tools.
pub use ember_core::pickle;
/// The profiler (`torch.profiler`): [`profiler::profile`], [`profiler::record_function`],
/// [`profiler::schedule`], `key_averages().table(..)`, `export_chrome_trace`.
pub use ember_core::profiler;
pub use ember_data as data;
pub use ember_distributed as distributed;
pub use ember_nn as nn;

/// Mixed precision (`torch.amp`): `autocast` regions (from `ember_core::amp`) and
/// `GradScaler` (from `ember_nn::amp`).
pub mod amp {
    pub use ember_core::amp::{
        autocast, autocast_cache_len, clear_autocast_cache, get_autocast_dtype, is_autocast_cache_enabled,
        is_autocast_enabled, Autocast, AutocastGuard,
    };
    pub use ember_nn::amp::*;
}

#[doc = include_str!("coming_from_pytorch.md")]
pub mod coming_from_pytorch {}

/// `torch.utils` for ember: [`utils::benchmark`] (`Timer`, `Measurement`).
pub mod utils {
    pub mod benchmark;
    /// `torch.utils.checkpoint`: [`checkpoint`](checkpoint::checkpoint) a borrowed module, or
    /// [`checkpoint_fn`](checkpoint::checkpoint_fn) an owned closure over several inputs.
    pub mod checkpoint {
        pub use ember_core::autograd::checkpoint as checkpoint_fn;
        pub use ember_nn::checkpoint::checkpoint;
    }
}

/// ember's version, from Cargo.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The README's example compiles and runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
