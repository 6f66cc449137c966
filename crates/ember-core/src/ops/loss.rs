//! The fused end of the class-index losses: [`Tensor::nll_loss_forward`], PyTorch's
//! `aten::nll_loss_forward` for `[M, C]` log-probabilities, which `cross_entropy` and
//! `nll_loss` (ember-nn) use for their summed and averaged forms: one kernel forward and one
//! (after a zero fill) backward, where the composite (compare, fill, gather, weight, mask,
//! negate, two sums, divide; and their backwards) launched about twenty.

use super::conv::packed;
use crate::autograd::{self, SavedTensor};
use crate::dispatch::{self, policy};
use crate::{DType, Error, Result, Tensor};

const OP: &str = "nll_loss_forward";

impl Tensor {
    /// The negative log-likelihood of the log-probability rows `self` (`[M, C]`, float) at the
    /// class indices `target` (`[M]`, int64 or int32), each row weighted by `weight[target]`
    /// (`[C]`, `self`'s dtype; 1 when `None`); rows whose target is `ignore_index` count for
    /// nothing. Returns the sum over the counted rows, divided by the sum of their weights
    /// when `mean` (`reduction='mean'`, NaN when no row counts), as a 0-d tensor. A target
    /// outside `0..C` is an [`Error::IndexOutOfRange`] (on a GPU reported at the next
    /// synchronizing call). Differentiable in `self`.
    pub fn nll_loss_forward(
        &self,
        target: &Tensor,
        weight: Option<&Tensor>,
        mean: bool,
        ignore_index: i64,
    ) -> Result<Tensor> {
        let mut inputs = vec![self, target];
        inputs.extend(weight);
        dispatch::call_list(&policy::NLL_LOSS_FORWARD, &inputs, |p| {
            nll_loss_prepared(&p[0], &p[1], p.get(2), mean, ignore_index)
        })
    }
}

fn nll_loss_prepared(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    mean: bool,
    ignore_index: i64,
) -> Result<Tensor> {
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(OP, input.dtype()));
    }
    if !matches!(target.dtype(), DType::I64 | DType::I32) {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: target.dtype(),
            hint: "class-index targets must be int64 (or int32)",
        });
    }
    let (m, c) = match input.dims() {
        &[m, c] if target.dims() == [m] => (m, c),
        _ => {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: input.shape().clone(),
                rhs: target.shape().clone(),
                hint: "the input must be [M, C] log-probabilities and the target [M] class indices",
            })
        }
    };
    if let Some(w) = weight {
        if w.dims() != [c] || w.dtype() != input.dtype() {
            return Err(Error::invalid(
                OP,
                format!(
                    "weight must be 1-D with one {} value per class ({c}), got {} {}",
                    input.dtype(),
                    w.dtype(),
                    w.shape()
                ),
            ));
        }
    }
    let (x, t) = (packed(input)?, packed(target)?);
    let w = weight.map(packed).transpose()?;
    let (loss, total) = {
        let (sx, st) = (x.storage().read(), t.storage().read());
        let sw = w.as_ref().map(|w| w.storage().read());
        sx.nll_loss_forward(&st, sw.as_deref(), (m, c), ignore_index, mean)?
    };
    let loss = Tensor::from_storage(loss, [0usize; 0]);
    if !autograd::needs_grad(&[input]) {
        return Ok(loss);
    }
    let total = Tensor::from_storage(total, [0usize; 0]);
    let (ts, ws) = (
        SavedTensor::new(OP, &t),
        w.as_ref().map(|w| SavedTensor::new(OP, w)),
    );
    // The node is PyTorch's NllLossBackward0.
    Ok(autograd::record("nll_loss", &[input], loss, move |g, _| {
        let g = packed(&g.to_dtype(total.dtype())?)?;
        let t = ts.get()?;
        let w = ws.as_ref().map(SavedTensor::get).transpose()?;
        let grad = {
            let (sg, st, stw) = (g.storage().read(), t.storage().read(), total.storage().read());
            let sw = w.as_ref().map(|w| w.storage().read());
            sg.nll_loss_backward(&st, sw.as_deref(), &stw, (m, c), ignore_index, mean)?
        };
        Ok(vec![Some(Tensor::from_storage(grad, [m, c]))])
    }))
}
