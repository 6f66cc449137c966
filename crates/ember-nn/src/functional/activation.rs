//! Activations under PyTorch's functional names (`F.gelu(x, approximate="tanh")`, `F.relu`,
//! `F.softmax(x, dim)`, ...): each is one ember-core elementwise or softmax op, so these are
//! the `torch.nn.functional` spellings of `x.gelu()`, `x.relu()`, `x.softmax(dim)`.

use ember_core::{Error, Result, Tensor};

/// How GELU computes the normal CDF (`approximate='none'` or `'tanh'`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GeluApproximate {
    /// The exact CDF with erf (PyTorch's default).
    #[default]
    None,
    /// The tanh approximation (GPT-2's `NewGELU`).
    Tanh,
}

impl std::str::FromStr for GeluApproximate {
    type Err = Error;

    /// PyTorch's strings: `"none"` or `"tanh"`.
    fn from_str(s: &str) -> Result<GeluApproximate> {
        match s {
            "none" => Ok(GeluApproximate::None),
            "tanh" => Ok(GeluApproximate::Tanh),
            _ => Err(Error::invalid(
                "gelu",
                format!("approximate argument must be either none or tanh, got {s:?}"),
            )),
        }
    }
}

/// Gaussian error linear unit `x Φ(x)` (`F.gelu(input, approximate=..)`):
/// `gelu(&x, GeluApproximate::Tanh)` for `approximate="tanh"`.
pub fn gelu(input: &Tensor, approximate: GeluApproximate) -> Result<Tensor> {
    match approximate {
        GeluApproximate::None => input.gelu(),
        GeluApproximate::Tanh => input.gelu_tanh(),
    }
}

/// `max(x, 0)` (`F.relu`).
pub fn relu(input: &Tensor) -> Result<Tensor> {
    input.relu()
}

/// `x σ(x)` (`F.silu`).
pub fn silu(input: &Tensor) -> Result<Tensor> {
    input.silu()
}

/// `1 / (1 + e^-x)` (`F.sigmoid`).
pub fn sigmoid(input: &Tensor) -> Result<Tensor> {
    input.sigmoid()
}

/// `tanh(x)` (`F.tanh`).
pub fn tanh(input: &Tensor) -> Result<Tensor> {
    input.tanh()
}

/// Softmax over `dim` (`F.softmax(input, dim)`).
pub fn softmax(input: &Tensor, dim: isize) -> Result<Tensor> {
    input.softmax(dim)
}

/// Log-softmax over `dim` (`F.log_softmax(input, dim)`).
pub fn log_softmax(input: &Tensor, dim: isize) -> Result<Tensor> {
    input.log_softmax(dim)
}
