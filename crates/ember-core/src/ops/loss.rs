//! The fused end of the class-index losses: [`Tensor::nll_loss_forward`], PyTorch's
//! `aten::nll_loss_forward` for `[M, C]` log-probabilities, which `cross_entropy` and
//! `nll_loss` (ember-nn) use for their summed and averaged forms: one kernel forward and one
//! (after a zero fill) backward, where the composite (compare, fill, gather, weight, mask,
//! negate, two sums, divide; and their backwards) launched about twenty; and the fused
//! classifier [`Tensor::cross_entropy_loss`], PyTorch's `aten::cross_entropy_loss` for `[N, C]`
//! logits, which `F::cross_entropy` (ember-nn) uses for that form.
//!
//! Note [Classifier in fp32]: cross-entropy is on PyTorch's fp32 autocast list, and its eager
//! form copies bf16 logits to f32, writes f32 log-probabilities (saved for backward) and
//! zero-fills an f32 gradient: for GPT-2's [8192, 50304] logits that is 1.65 GB a buffer, and
//! PyTorch measured 5.97 ms (276 GB/s) forward and backward on an H200. The fused op reads the
//! logits in their own dtype and computes in f32 inside (f64 for f64): forward one pass per row
//! (online max and sum) keeping only each row's log-sum-exp (f32 `[N]`), backward one pass
//! writing `(softmax - one_hot)·dloss` in the logits' dtype. Under autocast it gives the f32
//! loss of the upcast logits without making the upcast (`dispatch::call_list_fp32_inside`);
//! outside autocast the loss has the logits' dtype, rounded once. The gradient is always in
//! the logits' dtype, as the upcast's backward (a cast back) gives it. Sums run in a fixed
//! order (per-row losses, then one block), so the loss is the same bits on every run.
//!
//! Note [One-pass classifier]: for the mean or the sum, the gradient of the logits is
//! `(softmax - one_hot)·dloss/divisor`, and `dloss` is almost always the implicit 1 of
//! `loss.backward()`: so where the backend can (`LossOps::cross_entropy_forward_grad`: CUDA,
//! bf16 or f32 rows of at most 65,536 bf16 / 32,768 f32 classes in whole 16-byte vectors) the
//! forward writes that gradient while the row is in registers, reading the logits once instead
//! of twice, and the node keeps the gradient instead of the logits (the same memory). Its
//! backward hands it on as it is when its gradient is the implicit 1
//! (`autograd::is_implicit_one`), else multiplies it by the gradient (one more pass, and for
//! bf16 one more rounding than the two-pass path: at most one ulp). Not for f16: under a
//! GradScaler the unscaled gradient of a large vocabulary (p/N, ~1e-9) underflows f16, where
//! the two-pass backward multiplies by the scale first. The cost when no backward comes is
//! the gradient's write. Measured on an H200 (docs/benchmarks.md, session 47): see there.

use super::conv::packed;
use crate::autograd::{self, SavedTensor};
use crate::backend::{CrossEntropyParams, Reduction};
use crate::dispatch::{self, policy, Door};
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
        dispatch::call_list(&policy::NLL_LOSS_FORWARD, &inputs, |p, door| {
            nll_loss_prepared(&p[0], &p[1], p.get(2), mean, ignore_index, door)
        })
    }
}

fn nll_loss_prepared(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    mean: bool,
    ignore_index: i64,
    door: Door,
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
    let (x, t) = (packed(input, door)?, packed(target, door)?);
    let w = weight.map(|w| packed(w, door)).transpose()?;
    let (loss, total) = {
        let (sx, st) = (x.storage().read(), t.storage().read());
        let sw = w.as_ref().map(|w| w.storage().read());
        sx.nll_loss_forward(&st, sw.as_deref(), (m, c), ignore_index, mean)?
    };
    let loss = door.tensor(loss, [0usize; 0]);
    if !autograd::needs_grad(&[input]) {
        return Ok(loss);
    }
    let total = door.tensor(total, [0usize; 0]);
    let (ts, ws) = (
        SavedTensor::new(OP, &t),
        w.as_ref().map(|w| SavedTensor::new(OP, w)),
    );
    // The node is PyTorch's NllLossBackward0.
    Ok(door.record("nll_loss", &[input], loss, move |g, _| {
        let g = packed(&g.to_dtype(total.dtype())?, door)?;
        let t = ts.get()?;
        let w = ws.as_ref().map(SavedTensor::get).transpose()?;
        let grad = {
            let (sg, st, stw) = (g.storage().read(), t.storage().read(), total.storage().read());
            let sw = w.as_ref().map(|w| w.storage().read());
            sg.nll_loss_backward(&st, sw.as_deref(), &stw, (m, c), ignore_index, mean)?
        };
        Ok(vec![Some(door.tensor(grad, [m, c]))])
    }))
}

const CE: &str = "cross_entropy";

impl Tensor {
    /// Cross-entropy of the logit rows `self` (`[N, C]`, float) against the class indices
    /// `target` (`[N]`, int64 or int32), as PyTorch's `F.cross_entropy(input, target, weight,
    /// ignore_index=, reduction=, label_smoothing=)` for that form (`aten::cross_entropy_loss`):
    /// rows whose target is `ignore_index` count for nothing; `weight` (`[C]`, `self`'s dtype)
    /// weighs each row by its target's class and `mean` divides by the sum of those weights
    /// (NaN when no row counts); `label_smoothing` in `[0, 1]` mixes the target with the
    /// uniform distribution. Fused (Note [Classifier in fp32]): computed in f32 inside, the
    /// loss in `self`'s dtype (f32 for f16/bf16 logits under autocast), `[N]` for
    /// `Reduction::None`, else 0-d. A target outside `0..C` is an [`Error::IndexOutOfRange`]
    /// (on a GPU reported at the next synchronizing call). Differentiable in `self`.
    pub fn cross_entropy_loss(
        &self,
        target: &Tensor,
        weight: Option<&Tensor>,
        reduction: Reduction,
        ignore_index: i64,
        label_smoothing: f64,
    ) -> Result<Tensor> {
        let mut inputs = vec![self, target];
        inputs.extend(weight);
        dispatch::call_list_fp32_inside(&policy::CROSS_ENTROPY, &inputs, |p, f32_result, door| {
            let out_dtype = if f32_result { DType::F32 } else { p[0].dtype() };
            cross_entropy_prepared(
                &p[0],
                &p[1],
                p.get(2),
                reduction,
                ignore_index,
                label_smoothing,
                out_dtype,
                door,
            )
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn cross_entropy_prepared(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    reduction: Reduction,
    ignore_index: i64,
    label_smoothing: f64,
    out_dtype: DType,
    door: Door,
) -> Result<Tensor> {
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(CE, input.dtype()));
    }
    if !matches!(target.dtype(), DType::I64 | DType::I32) {
        return Err(Error::UnsupportedDType {
            op: CE,
            dtype: target.dtype(),
            hint: "class-index targets must be int64 (or int32)",
        });
    }
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(Error::invalid(
            CE,
            format!("label_smoothing must be between 0.0 and 1.0, got {label_smoothing}"),
        ));
    }
    let (n, c) = match input.dims() {
        &[n, c] if target.dims() == [n] => (n, c),
        _ => {
            return Err(Error::ShapeMismatch {
                op: CE,
                lhs: input.shape().clone(),
                rhs: target.shape().clone(),
                hint: "the input must be [N, C] logits and the target [N] class indices",
            })
        }
    };
    let acc = if input.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let w = match weight {
        None => None,
        // Under autocast the weight arrives cast to f32 (`call_list_fp32_inside`).
        Some(w) if w.dims() == [c] && (w.dtype() == input.dtype() || w.dtype() == out_dtype) => {
            Some(packed(&w.to_dtype(acc)?, door)?)
        }
        Some(w) => {
            return Err(Error::invalid(
                CE,
                format!(
                    "weight must be 1-D with one {} value per class ({c}), got {} {}",
                    input.dtype(),
                    w.dtype(),
                    w.shape()
                ),
            ))
        }
    };
    let p = CrossEntropyParams {
        n,
        c,
        ignore_index,
        label_smoothing,
        reduction,
        out_dtype,
    };
    let (x, t) = (packed(input, door)?, packed(target, door)?);
    if reduction != Reduction::None && autograd::needs_grad(&[input]) {
        let one_pass = {
            let (sx, st) = (x.storage().read(), t.storage().read());
            let sw = w.as_ref().map(|w| w.storage().read());
            sx.cross_entropy_forward_grad(&st, sw.as_deref(), &p)?
        };
        if let Some((loss, _total, grad)) = one_pass {
            let loss = door.tensor(loss, [0usize; 0]);
            let grad = SavedTensor::new(CE, &door.tensor(grad, [n, c]));
            // Note [One-pass classifier]: the gradient was written by the forward.
            return Ok(door.record("cross_entropy_loss", &[input], loss, move |g, _| {
                let grad = grad.get()?;
                if autograd::is_implicit_one(g) {
                    return Ok(vec![Some(grad.clone())]);
                }
                let g = packed(&g.to_dtype(acc)?, door)?;
                let scaled = grad.storage().read().cross_entropy_rescale(&g.storage().read())?;
                Ok(vec![Some(door.tensor(scaled, [n, c]))])
            }));
        }
    }
    let (loss, lse, total) = {
        let (sx, st) = (x.storage().read(), t.storage().read());
        let sw = w.as_ref().map(|w| w.storage().read());
        sx.cross_entropy_forward(&st, sw.as_deref(), &p)?
    };
    let loss = if reduction == Reduction::None {
        door.tensor(loss, [n])
    } else {
        door.tensor(loss, [0usize; 0])
    };
    if !autograd::needs_grad(&[input]) {
        return Ok(loss);
    }
    let lse = door.tensor(lse, [n]);
    let total = door.tensor(total, [2]);
    let (xs, ts) = (SavedTensor::new(CE, &x), SavedTensor::new(CE, &t));
    let ws = w.as_ref().map(|w| SavedTensor::new(CE, w));
    // The node is PyTorch's (log_softmax + nll_loss) pair, fused: one node.
    Ok(door.record("cross_entropy_loss", &[input], loss, move |g, _| {
        let g = packed(&g.to_dtype(acc)?, door)?;
        let (x, t) = (xs.get()?, ts.get()?);
        let w = ws.as_ref().map(SavedTensor::get).transpose()?;
        let grad = {
            let (sx, st, sl, stw, sg) = (
                x.storage().read(),
                t.storage().read(),
                lse.storage().read(),
                total.storage().read(),
                g.storage().read(),
            );
            let sw = w.map(|w| w.storage().read());
            sx.cross_entropy_backward(&st, sw.as_deref(), &sl, &stw, &sg, &p)?
        };
        Ok(vec![Some(door.tensor(grad, [n, c]))])
    }))
}
