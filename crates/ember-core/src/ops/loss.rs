//! The losses of `torch.nn.functional`, entering the dispatch point under PyTorch's names:
//! [`nll_loss`], [`cross_entropy`], [`mse_loss`], [`l1_loss`] and
//! [`binary_cross_entropy_with_logits`], with PyTorch's reductions (ember-nn's functional API
//! keeps `F.cross_entropy`'s keyword arguments over them), and their fused ends.
//!
//! Class-index losses flatten `[N, C, d1, ..]` inputs to `[M, C]` rows (class dim last) and
//! pick each row's target log-probability with one `gather`; ignored targets (and the class
//! weights) enter as a per-row weight, so `mean` is PyTorch's weighted mean
//! `Σ wᵢ lossᵢ / Σ wᵢ` over the non-ignored rows. Cross-entropy of `[N, C]` logits against
//! class indices is the fused classifier ([`Tensor::cross_entropy_loss`]: the loss and its
//! gradient `softmax - one_hot` in one pass each over the logits, computed in f32 inside,
//! never keeping the `[N, C]` log-probabilities); its other forms are `log_softmax` followed by
//! the class-index loss.
//!
//! The fused ends: [`Tensor::nll_loss_forward`], PyTorch's `aten::nll_loss_forward` for
//! `[M, C]` log-probabilities, which `cross_entropy` and `nll_loss` use for their summed and
//! averaged forms: one kernel forward and one (after a zero fill) backward, where the
//! composite (compare, fill, gather, weight, mask, negate, two sums, divide; and their
//! backwards) launched about twenty; and the fused classifier [`Tensor::cross_entropy_loss`],
//! PyTorch's `aten::cross_entropy_loss` for `[N, C]` logits.
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

use super::conv::{as_isize, packed};
use crate::autograd::{self, SavedTensor};
use crate::backend::{CrossEntropyParams, Reduction};
use crate::dispatch::{self, policy, Door};
use crate::{DType, Error, Result, Tensor};

/// `loss` reduced by `reduction`, the mean over all elements.
fn reduce(loss: Tensor, reduction: Reduction) -> Result<Tensor> {
    match reduction {
        Reduction::None => Ok(loss),
        Reduction::Mean => loss.mean_all(),
        Reduction::Sum => loss.sum_all(),
    }
}

/// Checks a class-index loss's operands and flattens them: the input as `[M, C]` rows, the
/// target as `[M]`, and the target's shape (for `Reduction::None`).
fn rows(op: &'static str, input: &Tensor, target: &Tensor) -> Result<(Tensor, Tensor, Vec<usize>)> {
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(op, input.dtype()));
    }
    if !matches!(target.dtype(), DType::I64 | DType::I32) {
        return Err(Error::UnsupportedDType {
            op,
            dtype: target.dtype(),
            hint: "class-index targets must be int64 (or pass class probabilities of the input's dtype to cross_entropy)",
        });
    }
    let expected: Vec<usize> = match input.rank() {
        0 | 1 => vec![],
        _ => input
            .dims()
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != 1)
            .map(|(_, &d)| d)
            .collect(),
    };
    if input.rank() == 0 || target.dims() != expected.as_slice() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: input.shape().clone(),
            rhs: target.shape().clone(),
            hint: "the input must be [C] or [N, C, d1, ..] and the target [] or [N, d1, ..] of class indices",
        });
    }
    let c = input.dims()[if input.rank() == 1 { 0 } else { 1 }];
    let x = if input.rank() > 2 {
        let mut perm: Vec<isize> = (0..input.rank() as isize).filter(|&d| d != 1).collect();
        perm.push(1);
        input.permute(&perm)?
    } else {
        input.clone()
    };
    let m = target.numel();
    Ok((
        x.reshape(&as_isize(&[m, c]))?,
        target.reshape(&[m as isize])?,
        expected,
    ))
}

/// Per-row negative log-likelihood of `logp` `[M, C]` at `target` `[M]`, and the row weights
/// (class weight of the target, 0 for ignored rows).
fn picked_nll(
    op: &'static str,
    logp: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
) -> Result<(Tensor, Tensor)> {
    let c = logp.dims()[1];
    let ignored = target.eq_scalar(ignore_index)?;
    let safe = target.masked_fill(&ignored, 0)?;
    let picked = logp.gather(1, &safe.unsqueeze(1)?)?.squeeze_dim(1)?;
    let w = match weight {
        Some(w) => {
            if w.dims() != [c] {
                return Err(Error::invalid(
                    op,
                    format!(
                        "weight must be 1-D with one value per class ({c}), got shape {}",
                        w.shape()
                    ),
                ));
            }
            w.index_select(0, &safe)?
        }
        None => picked.ones_like()?,
    };
    let w = w.masked_fill(&ignored, 0.0)?;
    Ok((picked.neg()?.mul(&w)?, w))
}

/// Reduces per-row losses with the row weights `w` (PyTorch's weighted mean for `Mean`).
fn reduce_weighted(loss: Tensor, w: &Tensor, reduction: Reduction, shape: &[usize]) -> Result<Tensor> {
    match reduction {
        Reduction::None => loss.reshape(&as_isize(shape)),
        Reduction::Sum => loss.sum_all(),
        Reduction::Mean => loss.sum_all()?.div(&w.sum_all()?),
    }
}

/// Negative log-likelihood of log-probabilities `input` (`[C]` or `[N, C, d1, ..]`) at the
/// class indices `target` (`[]` or `[N, d1, ..]`, int64), with optional class `weight`; targets
/// equal to `ignore_index` count for nothing (`F.nll_loss`; PyTorch's default is -100).
pub fn nll_loss(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
    reduction: Reduction,
) -> Result<Tensor> {
    dispatch::composite_list(&policy::NLL_LOSS, &[Some(input), Some(target), weight], |ins| {
        let [Some(input), Some(target), weight] = ins else {
            unreachable!("nll_loss's input and target are always given")
        };
        nll_loss_composite(input, target, weight.as_ref(), ignore_index, reduction)
    })
}

fn nll_loss_composite(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
    reduction: Reduction,
) -> Result<Tensor> {
    const OP: &str = "nll_loss";
    let (x, t, shape) = rows(OP, input, target)?;
    if let Some(loss) = fused_nll(&x, &t, weight, ignore_index, reduction)? {
        return Ok(loss);
    }
    let (loss, w) = picked_nll(OP, &x, &t, weight, ignore_index)?;
    reduce_weighted(loss, &w, reduction, &shape)
}

/// The summed or averaged loss of the rows in one fused op ([`Tensor::nll_loss_forward`]);
/// `None` for `Reduction::None` (per-row losses come from the composite) or a weight that does
/// not fit (the composite then reports it).
fn fused_nll(
    logp: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
    reduction: Reduction,
) -> Result<Option<Tensor>> {
    let mean = match reduction {
        Reduction::None => return Ok(None),
        Reduction::Sum => false,
        Reduction::Mean => true,
    };
    let c = logp.dims()[1];
    if weight.is_some_and(|w| w.dims() != [c] || w.dtype() != logp.dtype()) {
        return Ok(None);
    }
    logp.nll_loss_forward(target, weight, mean, ignore_index)
        .map(Some)
}

/// Cross-entropy of the logits `input` (`[C]` or `[N, C, d1, ..]`, classes in dim 1) against
/// `target` (`F.cross_entropy(input, target, weight, ignore_index=, reduction=,
/// label_smoothing=)`): either class indices (int64, `[]` or `[N, d1, ..]`), of which those
/// equal to `ignore_index` count for nothing, or class probabilities of the input's shape and
/// dtype. `weight` (`[C]`) weighs each class; `label_smoothing` in `[0, 1]` mixes the target
/// with the uniform distribution. `[N, C]` logits against `[N]` class indices take the fused
/// classifier ([`Tensor::cross_entropy_loss`]).
pub fn cross_entropy(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
    reduction: Reduction,
    label_smoothing: f64,
) -> Result<Tensor> {
    // `[N, C]` logits and `[N]` class indices: the fused classifier, which enters the dispatch
    // point as `cross_entropy` itself (f32 inside under autocast, without the upcast copy).
    let class_rows = input.rank() == 2 && target.rank() == 1 && target.dims()[0] == input.dims()[0];
    if class_rows && matches!(target.dtype(), DType::I64 | DType::I32) && input.dtype().is_floating_point() {
        return input.cross_entropy_loss(target, weight, reduction, ignore_index, label_smoothing);
    }
    dispatch::composite_list(
        &policy::CROSS_ENTROPY,
        &[Some(input), Some(target), weight],
        |ins| {
            let [Some(input), Some(target), weight] = ins else {
                unreachable!("cross_entropy's input and target are always given")
            };
            cross_entropy_composite(
                input,
                target,
                weight.as_ref(),
                ignore_index,
                reduction,
                label_smoothing,
            )
        },
    )
}

fn cross_entropy_composite(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: i64,
    reduction: Reduction,
    label_smoothing: f64,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(Error::invalid(
            OP,
            format!("label_smoothing must be between 0.0 and 1.0, got {label_smoothing}"),
        ));
    }
    if target.dtype().is_floating_point() {
        return cross_entropy_probs(input, target, weight, reduction, label_smoothing);
    }
    let (x, t, shape) = rows(OP, input, target)?;
    let c = x.dims()[1];
    let logp = x.log_softmax(1)?;
    if label_smoothing == 0.0 {
        if let Some(loss) = fused_nll(&logp, &t, weight, ignore_index, reduction)? {
            return Ok(loss);
        }
    }
    let (loss, w) = picked_nll(OP, &logp, &t, weight, ignore_index)?;
    let nll = reduce_weighted(loss, &w, reduction, &shape)?;
    if label_smoothing == 0.0 {
        return Ok(nll);
    }
    // PyTorch: (1 - ε) nll + ε / C · Σ_c -w_c log p_c, ignored rows zeroed, the mean divided
    // by the same Σ wᵢ as the nll term.
    let weighted = match weight {
        Some(cw) => logp.mul(&cw.unsqueeze(0)?)?,
        None => logp,
    };
    let ignored = t.eq_scalar(ignore_index)?;
    let smooth = weighted.sum_dim(1, false)?.neg()?.masked_fill(&ignored, 0.0)?;
    let smooth = reduce_weighted(smooth, &w, reduction, &shape)?;
    nll.mul_scalar(1.0 - label_smoothing)?
        .add(&smooth.mul_scalar(label_smoothing / c as f64)?)
}

/// Cross-entropy against class probabilities (`target` of the input's shape).
fn cross_entropy_probs(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    reduction: Reduction,
    label_smoothing: f64,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    if target.shape() != input.shape() || input.rank() == 0 {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: input.shape().clone(),
            rhs: target.shape().clone(),
            hint: "class-probability targets must have the input's shape [C] or [N, C, d1, ..]",
        });
    }
    if target.dtype() != input.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: input.dtype(),
            found: target.dtype(),
        });
    }
    let cdim = if input.rank() == 1 { 0 } else { 1 };
    let c = input.dims()[cdim];
    let target = if label_smoothing > 0.0 {
        target
            .mul_scalar(1.0 - label_smoothing)?
            .add_scalar(label_smoothing / c as f64)?
    } else {
        target.clone()
    };
    let mut prod = input.log_softmax(cdim as isize)?.mul(&target)?;
    if let Some(w) = weight {
        if w.dims() != [c] {
            return Err(Error::invalid(
                OP,
                format!(
                    "weight must be 1-D with one value per class ({c}), got shape {}",
                    w.shape()
                ),
            ));
        }
        let mut wd = vec![1usize; input.rank()];
        wd[cdim] = c;
        prod = prod.mul(&w.reshape(&as_isize(&wd))?)?;
    }
    match reduction {
        Reduction::None => prod.sum_dim(cdim as isize, false)?.neg(),
        Reduction::Sum => prod.sum_all()?.neg(),
        Reduction::Mean => prod
            .sum_all()?
            .neg()?
            .div_scalar((input.numel() / c.max(1)) as f64),
    }
}

/// Checks that a pointwise loss's operands are floating point of one dtype.
fn check_pointwise(op: &'static str, input: &Tensor, target: &Tensor) -> Result<()> {
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(op, input.dtype()));
    }
    if target.dtype() != input.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: input.dtype(),
            found: target.dtype(),
        });
    }
    Ok(())
}

/// Squared error `(input - target)²` (`F.mse_loss`; the operands broadcast, as PyTorch does
/// with a warning).
pub fn mse_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    dispatch::composite(&policy::MSE_LOSS, [input, target], |[input, target]| {
        check_pointwise("mse_loss", input, target)?;
        reduce(input.sub(target)?.square()?, reduction)
    })
}

/// Absolute error `|input - target|` (`F.l1_loss`; the operands broadcast).
pub fn l1_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    dispatch::composite(&policy::L1_LOSS, [input, target], |[input, target]| {
        check_pointwise("l1_loss", input, target)?;
        reduce(input.sub(target)?.abs()?, reduction)
    })
}

/// Binary cross-entropy of the logits `input` against probabilities `target` of its shape
/// (`F.binary_cross_entropy_with_logits`), in the stable form
/// `(1 - t)·x - (1 + (pos_weight - 1)·t)·logσ(x)`, times the optional `weight`; both weights
/// broadcast against the input.
pub fn binary_cross_entropy_with_logits(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    pos_weight: Option<&Tensor>,
    reduction: Reduction,
) -> Result<Tensor> {
    dispatch::composite_list(
        &policy::BINARY_CROSS_ENTROPY_WITH_LOGITS,
        &[Some(input), Some(target), weight, pos_weight],
        |ins| {
            let [Some(input), Some(target), weight, pos_weight] = ins else {
                unreachable!("the input and target are always given")
            };
            bce_with_logits_prepared(input, target, weight.as_ref(), pos_weight.as_ref(), reduction)
        },
    )
}

fn bce_with_logits_prepared(
    input: &Tensor,
    target: &Tensor,
    weight: Option<&Tensor>,
    pos_weight: Option<&Tensor>,
    reduction: Reduction,
) -> Result<Tensor> {
    const OP: &str = "binary_cross_entropy_with_logits";
    check_pointwise(OP, input, target)?;
    if target.shape() != input.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: input.shape().clone(),
            rhs: target.shape().clone(),
            hint: "the target must have the input's shape",
        });
    }
    let log_sig = input.logsigmoid()?;
    let log_weight = match pos_weight {
        Some(pw) => pw.sub_scalar(1.0)?.mul(target)?.add_scalar(1.0)?.mul(&log_sig)?,
        None => log_sig,
    };
    let loss = target.neg()?.add_scalar(1.0)?.mul(input)?.sub(&log_weight)?;
    let loss = match weight {
        Some(w) => loss.mul(w)?,
        None => loss,
    };
    if loss.shape() != input.shape() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: input.shape().clone(),
            rhs: loss.shape().clone(),
            hint: "weight and pos_weight must broadcast to the input's shape",
        });
    }
    reduce(loss, reduction)
}
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
