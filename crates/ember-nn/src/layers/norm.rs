//! Normalization layers: [`BatchNorm1d`], [`BatchNorm2d`] (`nn.BatchNorm1d/2d`) and
//! [`LayerNorm`] (`nn.LayerNorm`).
//!
//! BatchNorm keeps `running_mean`, `running_var` and `num_batches_tracked` as buffers (with
//! `track_running_stats`). In training mode it normalizes with the batch statistics and
//! updates the running ones in place (`momentum`, or the cumulative average when `momentum`
//! is `None`, which reads `num_batches_tracked` back to the host); in evaluation mode it uses
//! the running statistics. Without `track_running_stats` it always uses batch statistics.

use super::{new_param, visit_opt, visit_opt_mut};
use crate::functional;
use crate::init;
use crate::module::{Forward, Module, TensorKind};
use ember_core::{no_grad, DType, Device, Error, Result, Tensor};

/// Keyword options of the BatchNorm layers, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNormConfig {
    /// Added to the variance for stability (default 1e-5).
    pub eps: f64,
    /// Weight of the new batch in the running statistics (default `Some(0.1)`); `None` for a
    /// cumulative moving average.
    pub momentum: Option<f64>,
    /// Whether the layer has a learnable per-channel `weight` and `bias` (default `true`).
    pub affine: bool,
    /// Whether the layer keeps running statistics (default `true`).
    pub track_running_stats: bool,
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        BatchNormConfig {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
        }
    }
}

macro_rules! batch_norm_layer {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $ranks:expr, $expected:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $ty {
            /// `[num_features]`, ones initially; `None` without `affine`.
            pub weight: Option<Tensor>,
            /// `[num_features]`, zeros initially; `None` without `affine`.
            pub bias: Option<Tensor>,
            /// Buffer `[num_features]`, zeros initially.
            pub running_mean: Option<Tensor>,
            /// Buffer `[num_features]`, ones initially.
            pub running_var: Option<Tensor>,
            /// Buffer: 0-d int64 count of training batches seen.
            pub num_batches_tracked: Option<Tensor>,
            /// Channels `C` of the input.
            pub num_features: usize,
            /// The options the layer was built with.
            pub config: BatchNormConfig,
            training: crate::module::Training,
        }

        impl $ty {
            #[doc = concat!("`nn.", $name, "(num_features)` on `device`.")]
            pub fn new(num_features: usize, device: Device) -> Result<$ty> {
                $ty::with_config(num_features, BatchNormConfig::default(), device)
            }

            #[doc = concat!("`nn.", $name, "(num_features, eps=.., momentum=.., ...)` on `device`.")]
            pub fn with_config(num_features: usize, config: BatchNormConfig, device: Device) -> Result<$ty> {
                let c = [num_features];
                let affine = |init: fn(&Tensor) -> Result<Tensor>| {
                    config.affine.then(|| new_param(&c, device, init)).transpose()
                };
                let (weight, bias) = (affine(init::ones_)?, affine(init::zeros_)?);
                let stats = config.track_running_stats;
                let buffer = |v: f64| stats.then(|| Tensor::full(c, v, DType::F32, device)).transpose();
                Ok($ty {
                    weight,
                    bias,
                    running_mean: buffer(0.0)?,
                    running_var: buffer(1.0)?,
                    num_batches_tracked: stats.then(|| Tensor::zeros((), DType::I64, device)).transpose()?,
                    num_features,
                    config,
                    training: crate::module::Training::new(true),
                })
            }

            /// Resets the running statistics to their initial values (`reset_running_stats`).
            pub fn reset_running_stats(&self) -> Result<()> {
                let _g = no_grad();
                for (t, v) in [(&self.running_mean, 0.0), (&self.running_var, 1.0), (&self.num_batches_tracked, 0.0)] {
                    if let Some(t) = t {
                        t.fill_(v)?;
                    }
                }
                Ok(())
            }
        }

        impl Forward for $ty {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                if !$ranks.contains(&x.rank()) {
                    return Err(Error::invalid(
                        $name,
                        format!(concat!("expected ", $expected, " input (got {}D input)"), x.rank()),
                    ));
                }
                batch_norm_forward(self.training.get(), &self.config, [&self.weight, &self.bias],
                    [&self.running_mean, &self.running_var, &self.num_batches_tracked], x)
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                visit_opt(prefix, "weight", &self.weight, TensorKind::Parameter, f);
                visit_opt(prefix, "bias", &self.bias, TensorKind::Parameter, f);
                visit_opt(prefix, "running_mean", &self.running_mean, TensorKind::Buffer, f);
                visit_opt(prefix, "running_var", &self.running_var, TensorKind::Buffer, f);
                visit_opt(prefix, "num_batches_tracked", &self.num_batches_tracked, TensorKind::Buffer, f);
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                visit_opt_mut(prefix, "weight", &mut self.weight, TensorKind::Parameter, f)?;
                visit_opt_mut(prefix, "bias", &mut self.bias, TensorKind::Parameter, f)?;
                visit_opt_mut(prefix, "running_mean", &mut self.running_mean, TensorKind::Buffer, f)?;
                visit_opt_mut(prefix, "running_var", &mut self.running_var, TensorKind::Buffer, f)?;
                visit_opt_mut(prefix, "num_batches_tracked", &mut self.num_batches_tracked, TensorKind::Buffer, f)
            }

            fn set_training(&self, training: bool) {
                self.training.set(training);
            }

            fn is_training(&self) -> bool {
                self.training.get()
            }
        }
    };
}

batch_norm_layer!(
    /// Batch normalization over `[N, C]` or `[N, C, L]` (`nn.BatchNorm1d`).
    BatchNorm1d, "BatchNorm1d", [2usize, 3], "2D or 3D"
);
batch_norm_layer!(
    /// Batch normalization over `[N, C, H, W]` (`nn.BatchNorm2d`).
    BatchNorm2d, "BatchNorm2d", [4usize], "4D"
);

/// The forward of both BatchNorm layers, as PyTorch's `_BatchNorm.forward`.
fn batch_norm_forward(
    training: bool,
    config: &BatchNormConfig,
    [weight, bias]: [&Option<Tensor>; 2],
    [running_mean, running_var, num_batches_tracked]: [&Option<Tensor>; 3],
    x: &Tensor,
) -> Result<Tensor> {
    let mut momentum = config.momentum.unwrap_or(0.0);
    if training && config.track_running_stats {
        if let Some(n) = num_batches_tracked {
            let _g = no_grad();
            n.add_scalar_(1)?;
            if config.momentum.is_none() {
                momentum = 1.0 / n.item_f64()?;
            }
        }
    }
    let use_batch_stats = training || running_mean.is_none() || running_var.is_none();
    // Running stats are updated while training, and used in evaluation.
    let (rm, rv) = if !training || config.track_running_stats {
        (running_mean.as_ref(), running_var.as_ref())
    } else {
        (None, None)
    };
    functional::batch_norm(
        x,
        rm,
        rv,
        weight.as_ref(),
        bias.as_ref(),
        use_batch_stats,
        momentum,
        config.eps,
    )
}

/// Keyword options of [`LayerNorm`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormConfig {
    /// Added to the variance for stability (default 1e-5).
    pub eps: f64,
    /// Whether the layer has learnable elementwise `weight` (and `bias`) (default `true`).
    pub elementwise_affine: bool,
    /// Whether the affine part has a `bias` (default `true`).
    pub bias: bool,
}

impl Default for LayerNormConfig {
    fn default() -> Self {
        LayerNormConfig {
            eps: 1e-5,
            elementwise_affine: true,
            bias: true,
        }
    }
}

/// Layer normalization over the last dims (`nn.LayerNorm(normalized_shape)`).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// `normalized_shape`, ones initially; `None` without `elementwise_affine`.
    pub weight: Option<Tensor>,
    /// `normalized_shape`, zeros initially; `None` without `elementwise_affine` or `bias`.
    pub bias: Option<Tensor>,
    /// The trailing dims normalized over.
    pub normalized_shape: Vec<usize>,
    /// The options the layer was built with.
    pub config: LayerNormConfig,
    training: crate::module::Training,
}

impl LayerNorm {
    /// `nn.LayerNorm(normalized_shape)` on `device`.
    pub fn new(normalized_shape: &[usize], device: Device) -> Result<LayerNorm> {
        LayerNorm::with_config(normalized_shape, LayerNormConfig::default(), device)
    }

    /// `nn.LayerNorm(normalized_shape, eps=.., elementwise_affine=.., bias=..)` on `device`.
    pub fn with_config(
        normalized_shape: &[usize],
        config: LayerNormConfig,
        device: Device,
    ) -> Result<LayerNorm> {
        if normalized_shape.is_empty() {
            return Err(Error::invalid("LayerNorm", "normalized_shape must not be empty"));
        }
        let affine = config.elementwise_affine;
        Ok(LayerNorm {
            weight: affine
                .then(|| new_param(normalized_shape, device, init::ones_))
                .transpose()?,
            bias: (affine && config.bias)
                .then(|| new_param(normalized_shape, device, init::zeros_))
                .transpose()?,
            normalized_shape: normalized_shape.to_vec(),
            config,
            training: crate::module::Training::new(true),
        })
    }

    /// The residual add before this norm, fused (`x = x + branch; y = ln(x)`, as GPT-2's blocks
    /// do): `(x + residual, self(x + residual))` in one kernel forward where it can, the same
    /// values and gradients as `add` then `forward` (`ember_core::fused::add_layer_norm`).
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        ember_core::fused::add_layer_norm(
            x,
            residual,
            &self.normalized_shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.config.eps,
        )
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        functional::layer_norm(
            x,
            &self.normalized_shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.config.eps,
        )
    }
}

impl Module for LayerNorm {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        visit_opt(prefix, "weight", &self.weight, TensorKind::Parameter, f);
        visit_opt(prefix, "bias", &self.bias, TensorKind::Parameter, f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        visit_opt_mut(prefix, "weight", &mut self.weight, TensorKind::Parameter, f)?;
        visit_opt_mut(prefix, "bias", &mut self.bias, TensorKind::Parameter, f)
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }

    fn is_training(&self) -> bool {
        self.training.get()
    }
}
