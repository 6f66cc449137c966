//! Normalization with PyTorch's functional arguments: `batch_norm` (ember-core's
//! `ops::batch_norm`: training statistics with in-place running-stat updates, or evaluation
//! with the running stats) and `layer_norm` (ember-core's fused op, `Tensor::layer_norm`: one
//! kernel forward, one backward, fp32 inside).

use ember_core::{Result, Tensor};

/// Batch normalization over dim 1 of `[N, C, *]` (`F.batch_norm`): ember-core's
/// [`ember_core::ops::batch_norm::batch_norm`] with PyTorch's functional argument order.
///
/// Training (`training = true`) normalizes with the batch's mean and biased variance and, when
/// given, updates `running_mean` and `running_var` in place (under `no_grad`) as
/// `(1 - momentum)·running + momentum·batch`, with the unbiased variance for `running_var`.
/// Evaluation normalizes with the running stats, which must then be given.
///
/// The input must be floating point, as PyTorch's: an integer or bool input is
/// [`Error::UnsupportedDType`](ember_core::Error::UnsupportedDType) (convert it first, e.g.
/// `x.to_dtype(DType::F32)`), even where float32 statistics or affine parameters would
/// otherwise promote it.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    input: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    ember_core::ops::batch_norm::batch_norm(
        input,
        weight,
        bias,
        running_mean,
        running_var,
        training,
        momentum,
        eps,
    )
}

/// Layer normalization over the last `normalized_shape.len()` dims, which must equal
/// `normalized_shape`, with optional elementwise `weight` and `bias` of that shape
/// (`F.layer_norm`): ember-core's fused op ([`Tensor::layer_norm`], one kernel each way).
pub fn layer_norm(
    input: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    input.layer_norm(normalized_shape, weight, bias, eps)
}
