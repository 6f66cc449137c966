//! [`Linear`]: `y = x Wᵀ + b` (`nn.Linear`).

use super::{new_param, visit_opt, visit_opt_mut};
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{Device, Result, Tensor};

/// Keyword options of [`Linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearConfig {
    /// Whether the layer adds a learnable bias (PyTorch default `true`).
    pub bias: bool,
}

impl Default for LinearConfig {
    fn default() -> Self {
        LinearConfig { bias: true }
    }
}

/// A fully connected layer over the last dim (`nn.Linear(in_features, out_features)`).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`, uniform on `±1/√in_features` initially.
    pub weight: Tensor,
    /// `[out_features]`, uniform on `±1/√in_features` initially; `None` without bias.
    pub bias: Option<Tensor>,
    /// Size of each input sample.
    pub in_features: usize,
    /// Size of each output sample.
    pub out_features: usize,
    training: crate::module::Training,
}

impl Linear {
    /// `nn.Linear(in_features, out_features)` with a bias, on `device`.
    pub fn new(in_features: usize, out_features: usize, device: Device) -> Result<Linear> {
        Linear::with_config(in_features, out_features, LinearConfig::default(), device)
    }

    /// `nn.Linear(in_features, out_features, bias=config.bias)` on `device`.
    pub fn with_config(
        in_features: usize,
        out_features: usize,
        config: LinearConfig,
        device: Device,
    ) -> Result<Linear> {
        let weight = new_param(&[out_features, in_features], device, init::default_weight_)?;
        let bias = config
            .bias
            .then(|| new_param(&[out_features], device, |b| init::default_bias_(b, in_features)))
            .transpose()?;
        Ok(Linear {
            weight,
            bias,
            in_features,
            out_features,
            training: crate::module::Training::new(true),
        })
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::functional::linear(x, &self.weight, self.bias.as_ref())
    }
}

impl Module for Linear {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "weight"), &self.weight, TensorKind::Parameter);
        visit_opt(prefix, "bias", &self.bias, TensorKind::Parameter, f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        f(
            &join_name(prefix, "weight"),
            &mut self.weight,
            TensorKind::Parameter,
        )?;
        visit_opt_mut(prefix, "bias", &mut self.bias, TensorKind::Parameter, f)
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }

    fn is_training(&self) -> bool {
        self.training.get()
    }
}
