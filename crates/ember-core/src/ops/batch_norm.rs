//! Batch normalization (`torch.batch_norm`): training statistics with in-place running-stat
//! updates, or evaluation with the running stats, entering the dispatch point as one
//! `batch_norm` (a composite: its inner ops pass it too).
//!
//! It normalizes as `(x - mean) · rsqrt(var + eps) · weight + bias` with the biased variance,
//! through `mean_dims`/`var` and elementwise ops, so autograd derives the backward.

use crate::dispatch::{self, policy};
use crate::{Error, Result, Tensor};

/// `t` (1-D with `c` elements) shaped to broadcast over dim 1 of a rank-`rank` input.
fn per_channel(op: &'static str, name: &str, t: &Tensor, c: usize, rank: usize) -> Result<Tensor> {
    if t.dims() != [c] {
        return Err(Error::invalid(
            op,
            format!(
                "{name} must be 1-D with {c} elements (one per channel), got shape {}",
                t.shape()
            ),
        ));
    }
    let mut dims = vec![1usize; rank];
    dims[1] = c;
    let dims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
    t.reshape(&dims)
}

/// Batch normalization over dim 1 of `[N, C, *]` (`torch.batch_norm`; `F.batch_norm` in
/// ember-nn takes PyTorch's functional argument order).
///
/// Training (`training = true`) normalizes with the batch's mean and biased variance and, when
/// given, updates `running_mean` and `running_var` in place (under `no_grad`) as
/// `(1 - momentum)·running + momentum·batch`, with the unbiased variance for `running_var`.
/// Evaluation normalizes with the running stats, which must then be given.
///
/// The input must be floating point, as PyTorch's: an integer or bool input is
/// [`Error::UnsupportedDType`] (convert it first, e.g. `x.to_dtype(DType::F32)`), even where
/// float32 statistics or affine parameters would otherwise promote it.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    input: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    if !input.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op: "batch_norm",
            dtype: input.dtype(),
            hint: "batch_norm normalizes floating-point inputs; convert the input first, e.g. \
                   x.to_dtype(DType::F32)",
        });
    }
    let inputs = [Some(input), running_mean, running_var, weight, bias];
    dispatch::composite_list(&policy::BATCH_NORM, &inputs, |ins| {
        let [Some(input), rm, rv, w, b] = ins else {
            unreachable!("batch_norm's input is always given")
        };
        // Mixed precision (a half input with float32 statistics and affine parameters, as
        // autocast leaves them): compute in the wider dtype, return the input's (PyTorch's
        // cuDNN and native kernels do the same).
        let wide = [rm, rv, w, b]
            .into_iter()
            .flatten()
            .fold(input.dtype(), |d, t| d.promote(t.dtype()));
        let x = input.to_dtype(wide)?;
        let y = batch_norm_prepared(
            &x,
            rm.as_ref(),
            rv.as_ref(),
            w.as_ref(),
            b.as_ref(),
            training,
            momentum,
            eps,
        )?;
        y.to_dtype(input.dtype())
    })
}

#[allow(clippy::too_many_arguments)]
fn batch_norm_prepared(
    input: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    const OP: &str = "batch_norm";
    if input.rank() < 2 {
        return Err(Error::invalid(
            OP,
            format!(
                "expected an input of at least 2 dims [N, C, *], got shape {}",
                input.shape()
            ),
        ));
    }
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(OP, input.dtype()));
    }
    let (rank, c) = (input.rank(), input.dims()[1]);
    let stat = |name: &str, t: Option<&Tensor>| t.map(|t| per_channel(OP, name, t, c, rank)).transpose();
    let (rm, rv) = (
        stat("running_mean", running_mean)?,
        stat("running_var", running_var)?,
    );
    let (w, b) = (stat("weight", weight)?, stat("bias", bias)?);
    let (mean, var) = if training {
        let n = input.numel() / c.max(1);
        if n <= 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected more than 1 value per channel when training, got input of shape {}",
                    input.shape()
                ),
            ));
        }
        let dims: Vec<isize> = (0..rank as isize).filter(|&d| d != 1).collect();
        let mean = input.mean_dims(&dims, true)?;
        let var = input.var(&dims, 0.0, true)?;
        {
            let _g = crate::no_grad();
            let unbiased = n as f64 / (n - 1) as f64;
            if let Some(rm) = &rm {
                rm.mul_scalar_(1.0 - momentum)?
                    .add_(&mean.mul_scalar(momentum)?.to_dtype(rm.dtype())?)?;
            }
            if let Some(rv) = &rv {
                rv.mul_scalar_(1.0 - momentum)?
                    .add_(&var.mul_scalar(momentum * unbiased)?.to_dtype(rv.dtype())?)?;
            }
        }
        (mean, var)
    } else {
        match (rm, rv) {
            (Some(rm), Some(rv)) => (rm, rv),
            _ => {
                return Err(Error::invalid(
                    OP,
                    "running_mean and running_var must be given when training is false",
                ))
            }
        }
    };
    affine(input.sub(&mean)?.mul(&var.add_scalar(eps)?.rsqrt()?)?, w, b)
}

/// `y · weight + bias`, each optional.
fn affine(y: Tensor, weight: Option<Tensor>, bias: Option<Tensor>) -> Result<Tensor> {
    let y = match weight {
        Some(w) => y.mul(&w)?,
        None => y,
    };
    match bias {
        Some(b) => y.add(&b),
        None => Ok(y),
    }
}
