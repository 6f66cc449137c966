//! One import for the common case: `use ember::prelude::*;` brings what most programs use, under
//! the names a PyTorch program uses them by.
//!
//! - [`Tensor`], [`DType`], [`Device`], [`Shape`], [`Result`], [`Error`], [`no_grad`] and the
//!   [`tensor!`] macro (`torch.tensor`);
//! - [`nn`] and [`optim`] (`torch.nn`, `torch.optim`), [`F`] (`torch.nn.functional as F`);
//! - the traits whose methods every program calls: [`Module`] and [`ModuleExt`]
//!   (`parameters()`, `to_device`, `train()`/`eval()`, `state_dict()`), [`Forward`]
//!   (`model.forward(&x)`) and [`Optimizer`] (`opt.step()`, `opt.zero_grad()`).
//!
//! [`Result`] takes an optional error type (ember's by default), so a program's
//! `fn main() -> Result<(), Box<dyn std::error::Error>>` still means what it says under the glob.
//!
//! ```
//! use ember::prelude::*;
//! # fn main() -> Result<()> {
//! let model = nn::Sequential::new().with(nn::Linear::new(4, 2, Device::Cpu)?).with(nn::ReLU::new());
//! let mut opt = optim::SGD::new(model.parameters(), optim::SgdConfig { lr: 0.1, ..Default::default() })?;
//! let x = tensor!([[1.0, 2.0, 3.0, 4.0]]);
//! let loss = F::relu(&model.forward(&x)?)?.sum_all()?;
//! loss.backward()?;
//! opt.step()?;
//! model.eval(); // through `&self`
//! # Ok(())
//! # }
//! ```

pub use crate::nn::functional as F;
pub use crate::nn::optim::{self, Optimizer};
pub use crate::nn::{self, Forward, Module, ModuleExt};
pub use crate::{no_grad, tensor, DType, Device, Error, Result, Shape, Tensor};
