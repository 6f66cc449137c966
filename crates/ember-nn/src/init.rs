//! `torch.nn.init`: in-place initializers and the fan and gain helpers, with PyTorch's
//! formulas, drawing from the default generator of the tensor's device (so
//! `ember_core::manual_seed` makes a model's initial weights reproducible, and the same on CPU
//! and CUDA by Note [Philox stream]).
//!
//! Every initializer fills its tensor in place under `no_grad` (so parameters that require
//! grad can be initialized) and returns it. The layers use [`default_weight_`] and
//! [`default_bias_`], PyTorch's `reset_parameters` of `Linear` and `ConvNd`:
//! `kaiming_uniform_(w, a=√5)`, which is uniform on `±1/√fan_in`, and a bias uniform on
//! `±1/√fan_in`.

use ember_core::{no_grad, Error, Result, Tensor};

/// Which fan [`kaiming_uniform_`] and [`kaiming_normal_`] scale by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FanMode {
    /// Preserve the variance of the activations in the forward pass (PyTorch's default).
    #[default]
    FanIn,
    /// Preserve the variance of the gradients in the backward pass.
    FanOut,
}

/// The nonlinearity an initializer's gain is computed for (`nn.init.calculate_gain`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Nonlinearity {
    /// Linear, conv and sigmoid layers: gain 1.
    Linear,
    /// Sigmoid: gain 1.
    Sigmoid,
    /// Tanh: gain 5/3.
    Tanh,
    /// ReLU: gain √2.
    Relu,
    /// Leaky ReLU with this negative slope: gain `√(2 / (1 + slope²))`.
    LeakyRelu(f64),
    /// SELU: gain 3/4.
    Selu,
}

/// The recommended gain for `nonlinearity` (`nn.init.calculate_gain`).
pub fn calculate_gain(nonlinearity: Nonlinearity) -> f64 {
    match nonlinearity {
        Nonlinearity::Linear | Nonlinearity::Sigmoid => 1.0,
        Nonlinearity::Tanh => 5.0 / 3.0,
        Nonlinearity::Relu => 2f64.sqrt(),
        Nonlinearity::LeakyRelu(slope) => (2.0 / (1.0 + slope * slope)).sqrt(),
        Nonlinearity::Selu => 0.75,
    }
}

/// `(fan_in, fan_out)` of a weight of at least 2 dims: `size(1)·receptive` and
/// `size(0)·receptive`, where `receptive` is the product of the dims after the second
/// (`nn.init._calculate_fan_in_and_fan_out`).
pub fn calculate_fan_in_and_fan_out(tensor: &Tensor) -> Result<(usize, usize)> {
    let dims = tensor.dims();
    if dims.len() < 2 {
        return Err(Error::invalid(
            "calculate_fan_in_and_fan_out",
            format!(
                "fan in and fan out can not be computed for a tensor with fewer than 2 dimensions (shape {})",
                tensor.shape()
            ),
        ));
    }
    let receptive: usize = dims[2..].iter().product();
    Ok((dims[1] * receptive, dims[0] * receptive))
}

/// Runs an in-place fill under `no_grad` and returns the tensor.
fn fill(tensor: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let _g = no_grad();
    f(tensor)?;
    Ok(tensor.clone())
}

/// Fills with values uniform on `[a, b)` (`nn.init.uniform_`).
pub fn uniform_(tensor: &Tensor, a: f64, b: f64) -> Result<Tensor> {
    fill(tensor, |t| t.uniform_(a, b))
}

/// Fills with normal values of mean `mean` and standard deviation `std` (`nn.init.normal_`).
pub fn normal_(tensor: &Tensor, mean: f64, std: f64) -> Result<Tensor> {
    fill(tensor, |t| t.normal_(mean, std))
}

/// Fills with `value` (`nn.init.constant_`).
pub fn constant_(tensor: &Tensor, value: f64) -> Result<Tensor> {
    fill(tensor, |t| t.fill_(value))
}

/// Fills with zeros (`nn.init.zeros_`).
pub fn zeros_(tensor: &Tensor) -> Result<Tensor> {
    constant_(tensor, 0.0)
}

/// Fills with ones (`nn.init.ones_`).
pub fn ones_(tensor: &Tensor) -> Result<Tensor> {
    constant_(tensor, 1.0)
}

fn fan(tensor: &Tensor, mode: FanMode) -> Result<usize> {
    let (fan_in, fan_out) = calculate_fan_in_and_fan_out(tensor)?;
    Ok(match mode {
        FanMode::FanIn => fan_in,
        FanMode::FanOut => fan_out,
    })
}

/// Kaiming (He) uniform: uniform on `±gain·√(3 / fan)` with the gain of `nonlinearity`
/// (`nn.init.kaiming_uniform_(tensor, a, mode, nonlinearity)`; PyTorch's `a` is the slope of
/// `Nonlinearity::LeakyRelu(a)`). An empty tensor is left as it is, as in PyTorch.
pub fn kaiming_uniform_(tensor: &Tensor, mode: FanMode, nonlinearity: Nonlinearity) -> Result<Tensor> {
    if tensor.numel() == 0 {
        return Ok(tensor.clone());
    }
    let std = calculate_gain(nonlinearity) / (fan(tensor, mode)? as f64).sqrt();
    let bound = 3f64.sqrt() * std;
    uniform_(tensor, -bound, bound)
}

/// Kaiming (He) normal: normal with mean 0 and std `gain / √fan` (`nn.init.kaiming_normal_`).
pub fn kaiming_normal_(tensor: &Tensor, mode: FanMode, nonlinearity: Nonlinearity) -> Result<Tensor> {
    if tensor.numel() == 0 {
        return Ok(tensor.clone());
    }
    let std = calculate_gain(nonlinearity) / (fan(tensor, mode)? as f64).sqrt();
    normal_(tensor, 0.0, std)
}

/// Xavier (Glorot) uniform: uniform on `±gain·√(6 / (fan_in + fan_out))`
/// (`nn.init.xavier_uniform_`).
pub fn xavier_uniform_(tensor: &Tensor, gain: f64) -> Result<Tensor> {
    let (fan_in, fan_out) = calculate_fan_in_and_fan_out(tensor)?;
    let std = gain * (2.0 / (fan_in + fan_out) as f64).sqrt();
    let bound = 3f64.sqrt() * std;
    uniform_(tensor, -bound, bound)
}

/// Xavier (Glorot) normal: std `gain·√(2 / (fan_in + fan_out))` (`nn.init.xavier_normal_`).
pub fn xavier_normal_(tensor: &Tensor, gain: f64) -> Result<Tensor> {
    let (fan_in, fan_out) = calculate_fan_in_and_fan_out(tensor)?;
    let std = gain * (2.0 / (fan_in + fan_out) as f64).sqrt();
    normal_(tensor, 0.0, std)
}

/// PyTorch's default init of a `Linear`/`ConvNd` weight: `kaiming_uniform_(w, a=√5)`, i.e.
/// uniform on `±1/√fan_in`.
pub fn default_weight_(weight: &Tensor) -> Result<Tensor> {
    kaiming_uniform_(weight, FanMode::FanIn, Nonlinearity::LeakyRelu(5f64.sqrt()))
}

/// PyTorch's default init of a `Linear`/`ConvNd` bias: uniform on `±1/√fan_in` of the layer's
/// weight (zero bound when `fan_in` is 0).
pub fn default_bias_(bias: &Tensor, fan_in: usize) -> Result<Tensor> {
    let bound = if fan_in > 0 {
        1.0 / (fan_in as f64).sqrt()
    } else {
        0.0
    };
    uniform_(bias, -bound, bound)
}
