//! Linear and convolution layers as functions: `linear`, `conv1d`, `conv2d`, and `unfold`
//! (im2col). Convolution is ember-core's `ops::conv::convolution`, which runs on every device
//! through the backend's convolution (CPU im2col + GEMM, cuDNN on CUDA) and falls back to a
//! composite im2col-by-gather path where the backend does not run the problem; `unfold` is
//! that path's window gather (`ops::conv::unfold`). This file adds PyTorch's argument forms:
//! unbatched inputs and `Pair` geometry.

use super::Pair;
use ember_core::ops::conv as core_conv;
use ember_core::{Error, Result, Tensor};

/// `input @ weight.T + bias` (`F.linear`): `input` is `[*, in_features]`, `weight`
/// `[out_features, in_features]`, `bias` `[out_features]`.
pub fn linear(input: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    input.linear(weight, bias)
}

/// Sliding local blocks of a batched `[N, C, H, W]` input as `[N, C·KH·KW, L]` (`F.unfold`,
/// im2col), zero padded; `L` is the number of window positions.
pub fn unfold(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    dilation: impl Into<Pair>,
    padding: impl Into<Pair>,
    stride: impl Into<Pair>,
) -> Result<Tensor> {
    core_conv::unfold(
        input,
        kernel_size.into().0,
        dilation.into().0,
        padding.into().0,
        stride.into().0,
    )
}

/// 2-D convolution (cross-correlation) over `[N, C, H, W]` (or unbatched `[C, H, W]`) with
/// `weight` `[O, C/groups, KH, KW]` and optional `bias` `[O]` (`F.conv2d`); zero padding.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
    dilation: impl Into<Pair>,
    groups: usize,
) -> Result<Tensor> {
    let geometry = [stride.into().0, padding.into().0, dilation.into().0];
    convolution(
        "conv2d",
        input,
        weight,
        bias,
        geometry.map(|g| g.to_vec()),
        groups,
        2,
    )
}

/// 1-D convolution over `[N, C, L]` (or unbatched `[C, L]`) with `weight` `[O, C/groups, K]`
/// and optional `bias` `[O]` (`F.conv1d`); zero padding.
pub fn conv1d(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
    dilation: usize,
    groups: usize,
) -> Result<Tensor> {
    let geometry = [vec![stride], vec![padding], vec![dilation]];
    convolution("conv1d", input, weight, bias, geometry, groups, 1)
}

/// The convolution of `spatial` (1 or 2) dims, batched or not; `geometry` is stride, padding
/// and dilation.
fn convolution(
    op: &'static str,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    geometry: [Vec<usize>; 3],
    groups: usize,
    spatial: usize,
) -> Result<Tensor> {
    let batched = spatial + 2;
    if input.rank() != batched && input.rank() != batched - 1 {
        return Err(Error::invalid(
            op,
            format!(
                "expected a {}-D (batched) or {}-D (unbatched) input, got shape {}",
                batched,
                batched - 1,
                input.shape()
            ),
        ));
    }
    if weight.rank() != batched {
        return Err(Error::invalid(
            op,
            format!(
                "expected a {batched}-D weight [out_channels, in_channels/groups, kernel...], got shape {}",
                weight.shape()
            ),
        ));
    }
    if input.rank() == batched - 1 {
        return convolution(op, &input.unsqueeze(0)?, weight, bias, geometry, groups, spatial)?
            .squeeze_dim(0);
    }
    let [stride, padding, dilation] = &geometry;
    core_conv::convolution(input, weight, bias, stride, padding, dilation, groups)
}
