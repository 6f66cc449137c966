//! Pooling layers: [`MaxPool2d`], [`AvgPool2d`], [`AdaptiveAvgPool2d`] over `[N, C, H, W]` or
//! `[C, H, W]`; floor output sizes (`ceil_mode=False`), dilation 1, and `AvgPool2d` counts
//! padding in the divisor (`count_include_pad=True`), as `crate::functional::pooling`.

use super::stateless_module;
use crate::functional::{self, Pair};

/// Keyword options of [`MaxPool2d`] and [`AvgPool2d`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Step of the window; `None` (the default) means `kernel_size`.
    pub stride: Option<Pair>,
    /// Implicit padding on both sides, at most half the kernel (default 0).
    pub padding: Pair,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            stride: None,
            padding: Pair([0, 0]),
        }
    }
}

/// Maximum over each window (`nn.MaxPool2d(kernel_size)`).
#[derive(Debug, Clone)]
pub struct MaxPool2d {
    /// (height, width) of the window.
    pub kernel_size: Pair,
    /// Step of the window.
    pub stride: Pair,
    /// Implicit -inf padding.
    pub padding: Pair,
    training: crate::module::Training,
}

impl MaxPool2d {
    /// `nn.MaxPool2d(kernel_size)`: stride `kernel_size`, no padding.
    pub fn new(kernel_size: impl Into<Pair>) -> MaxPool2d {
        MaxPool2d::with_config(kernel_size, PoolConfig::default())
    }

    /// `nn.MaxPool2d(kernel_size, stride=.., padding=..)`.
    pub fn with_config(kernel_size: impl Into<Pair>, config: PoolConfig) -> MaxPool2d {
        let kernel_size = kernel_size.into();
        MaxPool2d {
            kernel_size,
            stride: config.stride.unwrap_or(kernel_size),
            padding: config.padding,
            training: crate::module::Training::new(true),
        }
    }
}

stateless_module!(MaxPool2d, |s, x| functional::max_pool2d(
    x,
    s.kernel_size,
    s.stride,
    s.padding
));

/// Mean over each window (`nn.AvgPool2d(kernel_size)`).
#[derive(Debug, Clone)]
pub struct AvgPool2d {
    /// (height, width) of the window.
    pub kernel_size: Pair,
    /// Step of the window.
    pub stride: Pair,
    /// Implicit zero padding, counted in the divisor.
    pub padding: Pair,
    training: crate::module::Training,
}

impl AvgPool2d {
    /// `nn.AvgPool2d(kernel_size)`: stride `kernel_size`, no padding.
    pub fn new(kernel_size: impl Into<Pair>) -> AvgPool2d {
        AvgPool2d::with_config(kernel_size, PoolConfig::default())
    }

    /// `nn.AvgPool2d(kernel_size, stride=.., padding=..)`.
    pub fn with_config(kernel_size: impl Into<Pair>, config: PoolConfig) -> AvgPool2d {
        let kernel_size = kernel_size.into();
        AvgPool2d {
            kernel_size,
            stride: config.stride.unwrap_or(kernel_size),
            padding: config.padding,
            training: crate::module::Training::new(true),
        }
    }
}

stateless_module!(AvgPool2d, |s, x| functional::avg_pool2d(
    x,
    s.kernel_size,
    s.stride,
    s.padding
));

/// Mean over adaptive windows giving a fixed output size (`nn.AdaptiveAvgPool2d`).
#[derive(Debug, Clone)]
pub struct AdaptiveAvgPool2d {
    /// (height, width) of the output.
    pub output_size: Pair,
    training: crate::module::Training,
}

impl AdaptiveAvgPool2d {
    /// `nn.AdaptiveAvgPool2d(output_size)`.
    pub fn new(output_size: impl Into<Pair>) -> AdaptiveAvgPool2d {
        AdaptiveAvgPool2d {
            output_size: output_size.into(),
            training: crate::module::Training::new(true),
        }
    }
}

stateless_module!(AdaptiveAvgPool2d, |s, x| functional::adaptive_avg_pool2d(
    x,
    s.output_size
));
