//! Losses: `cross_entropy`, `nll_loss`, `mse_loss`, `l1_loss` and
//! `binary_cross_entropy_with_logits`, with PyTorch's reductions.
//!
//! Class-index losses flatten `[N, C, d1, ..]` inputs to `[M, C]` rows (class dim last) and
//! pick each row's target log-probability with one `gather`; ignored targets (and the class
//! weights) enter as a per-row weight, so `mean` is PyTorch's weighted mean
//! `Σ wᵢ lossᵢ / Σ wᵢ` over the non-ignored rows. Cross-entropy of `[N, C]` logits against
//! class indices is ember-core's fused classifier ([`Tensor::cross_entropy_loss`]: the loss
//! and its gradient `softmax - one_hot` in one pass each over the logits, computed in f32
//! inside, never keeping the `[N, C]` log-probabilities); its other forms are `log_softmax`
//! followed by the class-index loss.

use super::idims;
use ember_core::dispatch::{self, policy};
use ember_core::{DType, Error, Result, Tensor};

/// How a loss reduces its per-element values (`reduction=` in PyTorch): ember-core's, where
/// the fused losses live.
pub use ember_core::Reduction;

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
        x.reshape(&idims(&[m, c]))?,
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
        Reduction::None => loss.reshape(&idims(shape)),
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
        nll_loss_prepared(input, target, weight.as_ref(), ignore_index, reduction)
    })
}

fn nll_loss_prepared(
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

/// The keyword arguments of [`cross_entropy_with`]; `Default` is PyTorch's (no weights,
/// `ignore_index` -100, mean, no smoothing). Build it as a struct or builder-style:
/// `CrossEntropyOptions::new().ignore_index(-1)`.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyOptions<'a> {
    /// Per-class weights `[C]` (`weight=`).
    pub weight: Option<&'a Tensor>,
    /// Class-index targets equal to this count for nothing (`ignore_index=`, -100).
    pub ignore_index: i64,
    /// How the per-element losses are reduced (`reduction=`, mean).
    pub reduction: Reduction,
    /// Mixes the target with the uniform distribution, in `[0, 1]` (`label_smoothing=`, 0).
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions<'_> {
    fn default() -> Self {
        CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
        }
    }
}

impl<'a> CrossEntropyOptions<'a> {
    /// PyTorch's defaults.
    pub fn new() -> CrossEntropyOptions<'a> {
        CrossEntropyOptions::default()
    }

    /// Sets `weight=`.
    pub fn weight(mut self, weight: &'a Tensor) -> CrossEntropyOptions<'a> {
        self.weight = Some(weight);
        self
    }

    /// Sets `ignore_index=`.
    pub fn ignore_index(mut self, ignore_index: i64) -> CrossEntropyOptions<'a> {
        self.ignore_index = ignore_index;
        self
    }

    /// Sets `reduction=`.
    pub fn reduction(mut self, reduction: Reduction) -> CrossEntropyOptions<'a> {
        self.reduction = reduction;
        self
    }

    /// Sets `label_smoothing=`.
    pub fn label_smoothing(mut self, label_smoothing: f64) -> CrossEntropyOptions<'a> {
        self.label_smoothing = label_smoothing;
        self
    }
}

/// Cross-entropy of the logits `input` (`[C]` or `[N, C, d1, ..]`, classes in dim 1) against
/// `target` (`F.cross_entropy(input, target)` with PyTorch's defaults): either class indices
/// (int64, `[]` or `[N, d1, ..]`) or class probabilities of the input's shape and dtype. The
/// keyword arguments are [`cross_entropy_with`]'s options.
pub fn cross_entropy(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    cross_entropy_with(input, target, CrossEntropyOptions::default())
}

/// `F.cross_entropy(input, target, weight=.., ignore_index=.., reduction=..,
/// label_smoothing=..)`: see [`CrossEntropyOptions`]; `label_smoothing` must be in `[0, 1]`.
pub fn cross_entropy_with(
    input: &Tensor,
    target: &Tensor,
    options: CrossEntropyOptions<'_>,
) -> Result<Tensor> {
    let CrossEntropyOptions {
        weight,
        ignore_index,
        reduction,
        label_smoothing,
    } = options;
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
            cross_entropy_prepared(
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

fn cross_entropy_prepared(
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
        prod = prod.mul(&w.reshape(&idims(&wd))?)?;
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
