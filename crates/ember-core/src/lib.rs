//! ember-core: tensors with a runtime dtype and device, autograd, and the compute backends.
//!
//! ```
//! use ember_core::{DType, Device, Tensor};
//! # fn main() -> ember_core::Result<()> {
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], Device::Cpu)?.requires_grad_(true)?;
//! let y = x.mul(&x)?.sum_all()?; // y = Σ x²
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok(())
//! # }
//! ```
//!
//! The layers and how to add an op: [`architecture`].

pub mod amp;
#[doc = include_str!("architecture.md")]
pub mod architecture {}
pub mod autograd;
pub mod backend;
pub mod backends;
pub mod cpu;
pub mod cuda;
pub(crate) mod cuda_backend;
pub mod device;
pub mod dispatch;
pub mod dtype;
pub mod error;
pub mod layout;
pub mod memory;
pub mod ops;
pub mod pickle;
pub mod profiler;
pub mod random;
pub mod shape;
pub mod storage;
pub mod tensor;

pub use autograd::{enable_grad, is_grad_enabled, no_grad, set_grad_enabled};
/// How a loss reduces its per-row values (`reduction=`).
pub use backend::Reduction;
pub use cpu::threads::{get_num_threads, set_num_threads};
pub use device::{Device, DeviceType};
pub use dtype::{DType, Element, Scalar, ScalarKind};
pub use error::{Error, Result};
/// GradScaler's device-side ops (`ember_core::amp_scaling::{non_finite_check_and_unscale_,
/// update_scale_}`).
pub use ops::amp_scaling;
pub use ops::foreach::foreach_copy_;
/// Fused multi-tensor optimizer steps (`ember_core::fused::{adam_, sgd_}`), the multi-tensor
/// norm and multiply, and the fused residual add + LayerNorm (`fused::add_layer_norm`).
pub use ops::fused_optim as fused;
pub use random::{
    default_generator, get_rng_state, initial_seed, manual_seed, seed, set_rng_state, Generator, RngState,
};
pub use shape::{Shape, Sizes};
pub use tensor::{HookHandle, Tensor};
