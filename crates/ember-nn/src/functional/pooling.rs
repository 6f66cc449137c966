//! 2-D pooling: `max_pool2d`, `avg_pool2d`, `adaptive_avg_pool2d` over `[N, C, H, W]` (or
//! unbatched `[C, H, W]`) inputs, floor output sizes (`ceil_mode=False`).
//!
//! `max_pool2d` and `avg_pool2d` are ember-core's `ops::pool::pool2d`, which runs on every
//! device through the backend's pooling (CPU kernels, cuDNN on CUDA) and falls back to a
//! composite window gather where the backend does not run the problem; the one difference
//! between devices: with tied maxima in a window, cuDNN may route max pooling's gradient to
//! another of the tied positions than the first. Adaptive average pooling is ember-core's
//! `ops::pool::adaptive_avg_pool2d`. This file adds PyTorch's argument forms (`Pair` sizes).

use super::Pair;
use ember_core::ops::pool::{pool2d, PoolMode};
use ember_core::{Error, Result, Tensor};

/// Runs `f` on a 4-D view of `input` (adding a batch dim of 1 to a 3-D input).
fn batched(op: &'static str, input: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    match input.rank() {
        4 => f(input),
        3 => f(&input.unsqueeze(0)?)?.squeeze_dim(0),
        _ => Err(Error::invalid(
            op,
            format!(
                "expected a 3-D [C, H, W] or 4-D [N, C, H, W] input, got shape {}",
                input.shape()
            ),
        )),
    }
}

/// Maximum over each `kernel_size` window moved by `stride`, with implicit -inf `padding`
/// (`F.max_pool2d`, dilation 1). PyTorch's default stride is `kernel_size`: pass it.
pub fn max_pool2d(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
) -> Result<Tensor> {
    let (k, s, p) = (kernel_size.into().0, stride.into().0, padding.into().0);
    batched("max_pool2d", input, |x| pool2d(x, PoolMode::Max, k, s, p))
}

/// Mean over each `kernel_size` window moved by `stride`, with zero `padding` counted in the
/// divisor (`F.avg_pool2d` with `count_include_pad=True`). PyTorch's default stride is
/// `kernel_size`: pass it.
pub fn avg_pool2d(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
) -> Result<Tensor> {
    let (k, s, p) = (kernel_size.into().0, stride.into().0, padding.into().0);
    batched("avg_pool2d", input, |x| pool2d(x, PoolMode::Avg, k, s, p))
}

/// Mean over the `output_size` windows that PyTorch's adaptive pooling uses: output `i` of a
/// dim of input size `n` and output size `o` averages `floor(i·n/o) .. ceil((i+1)·n/o)`
/// (`F.adaptive_avg_pool2d`): ember-core's [`ember_core::ops::pool::adaptive_avg_pool2d`].
pub fn adaptive_avg_pool2d(input: &Tensor, output_size: impl Into<Pair>) -> Result<Tensor> {
    ember_core::ops::pool::adaptive_avg_pool2d(input, output_size.into().0)
}
