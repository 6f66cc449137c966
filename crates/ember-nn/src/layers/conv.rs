//! [`Conv1d`] and [`Conv2d`] (`nn.Conv1d`, `nn.Conv2d`): zero padding
//! (`padding_mode='zeros'`), numeric padding only (no `'same'`/`'valid'` strings).

use super::{new_param, visit_opt, visit_opt_mut};
use crate::functional::{self, Pair};
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{Device, Error, Result, Tensor};

/// Keyword options of [`Conv1d`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dConfig {
    /// Step of the window (default 1).
    pub stride: usize,
    /// Zeros added on both sides (default 0).
    pub padding: usize,
    /// Spacing between kernel elements (default 1).
    pub dilation: usize,
    /// Blocked connections from input to output channels (default 1).
    pub groups: usize,
    /// Whether the layer adds a learnable bias (default `true`).
    pub bias: bool,
}

impl Default for Conv1dConfig {
    fn default() -> Self {
        Conv1dConfig {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
        }
    }
}

/// Keyword options of [`Conv2d`], with PyTorch's defaults; sizes per (height, width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dConfig {
    /// Step of the window (default 1).
    pub stride: Pair,
    /// Zeros added on both sides of each spatial dim (default 0).
    pub padding: Pair,
    /// Spacing between kernel elements (default 1).
    pub dilation: Pair,
    /// Blocked connections from input to output channels (default 1).
    pub groups: usize,
    /// Whether the layer adds a learnable bias (default `true`).
    pub bias: bool,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Conv2dConfig {
            stride: Pair([1, 1]),
            padding: Pair([0, 0]),
            dilation: Pair([1, 1]),
            groups: 1,
            bias: true,
        }
    }
}

/// Weight and bias of a convolution with `kernel` spatial dims, initialized as PyTorch's
/// `_ConvNd.reset_parameters`.
fn conv_params(
    op: &'static str,
    in_channels: usize,
    out_channels: usize,
    kernel: &[usize],
    groups: usize,
    bias: bool,
    device: Device,
) -> Result<(Tensor, Option<Tensor>)> {
    if groups == 0 || in_channels % groups != 0 || out_channels % groups != 0 {
        return Err(Error::invalid(
            op,
            format!("in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible by groups ({groups}), and groups positive"),
        ));
    }
    if kernel.contains(&0) {
        return Err(Error::invalid(
            op,
            format!("kernel_size must be positive, got {kernel:?}"),
        ));
    }
    let mut dims = vec![out_channels, in_channels / groups];
    dims.extend_from_slice(kernel);
    let weight = new_param(&dims, device, init::default_weight_)?;
    let fan_in = in_channels / groups * kernel.iter().product::<usize>();
    let bias = bias
        .then(|| new_param(&[out_channels], device, |b| init::default_bias_(b, fan_in)))
        .transpose()?;
    Ok((weight, bias))
}

/// 1-D convolution over `[N, C, L]` or `[C, L]` (`nn.Conv1d`).
#[derive(Debug, Clone)]
pub struct Conv1d {
    /// `[out_channels, in_channels / groups, kernel_size]`.
    pub weight: Tensor,
    /// `[out_channels]`, or `None` without bias.
    pub bias: Option<Tensor>,
    /// Channels of the input.
    pub in_channels: usize,
    /// Channels of the output.
    pub out_channels: usize,
    /// Length of the kernel.
    pub kernel_size: usize,
    /// The options the layer was built with.
    pub config: Conv1dConfig,
    training: crate::module::Training,
}

impl Conv1d {
    /// `nn.Conv1d(in_channels, out_channels, kernel_size)` on `device`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        device: Device,
    ) -> Result<Conv1d> {
        Conv1d::with_config(
            in_channels,
            out_channels,
            kernel_size,
            Conv1dConfig::default(),
            device,
        )
    }

    /// `nn.Conv1d(in_channels, out_channels, kernel_size, stride=.., ...)` on `device`.
    pub fn with_config(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        config: Conv1dConfig,
        device: Device,
    ) -> Result<Conv1d> {
        let (weight, bias) = conv_params(
            "Conv1d",
            in_channels,
            out_channels,
            &[kernel_size],
            config.groups,
            config.bias,
            device,
        )?;
        Ok(Conv1d {
            weight,
            bias,
            in_channels,
            out_channels,
            kernel_size,
            config,
            training: crate::module::Training::new(true),
        })
    }
}

/// 2-D convolution over `[N, C, H, W]` or `[C, H, W]` (`nn.Conv2d`).
#[derive(Debug, Clone)]
pub struct Conv2d {
    /// `[out_channels, in_channels / groups, kernel_h, kernel_w]`.
    pub weight: Tensor,
    /// `[out_channels]`, or `None` without bias.
    pub bias: Option<Tensor>,
    /// Channels of the input.
    pub in_channels: usize,
    /// Channels of the output.
    pub out_channels: usize,
    /// (height, width) of the kernel.
    pub kernel_size: Pair,
    /// The options the layer was built with.
    pub config: Conv2dConfig,
    training: crate::module::Training,
}

impl Conv2d {
    /// `nn.Conv2d(in_channels, out_channels, kernel_size)` on `device`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Into<Pair>,
        device: Device,
    ) -> Result<Conv2d> {
        Conv2d::with_config(
            in_channels,
            out_channels,
            kernel_size,
            Conv2dConfig::default(),
            device,
        )
    }

    /// `nn.Conv2d(in_channels, out_channels, kernel_size, stride=.., ...)` on `device`.
    pub fn with_config(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Into<Pair>,
        config: Conv2dConfig,
        device: Device,
    ) -> Result<Conv2d> {
        let kernel_size = kernel_size.into();
        let (weight, bias) = conv_params(
            "Conv2d",
            in_channels,
            out_channels,
            &kernel_size.0,
            config.groups,
            config.bias,
            device,
        )?;
        Ok(Conv2d {
            weight,
            bias,
            in_channels,
            out_channels,
            kernel_size,
            config,
            training: crate::module::Training::new(true),
        })
    }
}

macro_rules! conv_module {
    ($ty:ty, |$s:ident, $x:ident| $body:expr) => {
        impl Forward for $ty {
            fn forward(&self, $x: &Tensor) -> Result<Tensor> {
                let $s = self;
                $body
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                f(
                    &join_name(prefix, "weight"),
                    &self.weight,
                    TensorKind::Parameter,
                );
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
    };
}

conv_module!(Conv1d, |s, x| {
    let c = s.config;
    functional::conv1d(
        x,
        &s.weight,
        s.bias.as_ref(),
        c.stride,
        c.padding,
        c.dilation,
        c.groups,
    )
});

conv_module!(Conv2d, |s, x| {
    let c = s.config;
    functional::conv2d(
        x,
        &s.weight,
        s.bias.as_ref(),
        c.stride,
        c.padding,
        c.dilation,
        c.groups,
    )
});
