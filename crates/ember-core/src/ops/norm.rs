//! Layer normalization as one fused op (PyTorch's `native_layer_norm` and
//! `native_layer_norm_backward`): one kernel forward, which also saves each row's mean and
//! `rstd = 1/√(var + eps)` in the math type (f32; f64 for f64 inputs), and one kernel backward
//! for the input's gradient plus the parameters' (per-block partial sums and a small kernel
//! adding them in order: deterministic). fp32 math inside, one rounding at the end.
//!
//! Policy: PyTorch's CUDA autocast lists `layer_norm` as fp32 (its line in
//! `dispatch/policy.rs`): under autocast the input and parameters run in float32. Outside it,
//! the weight and bias have the input's dtype or, for an f16/bf16 input, float32 (PyTorch's
//! mixed-type kernels); both share one dtype.
//!
//! Backward runs under `no_grad` (ember has no double backward), so the backward kernel's
//! results are plain tensors; the op saves x, mean, rstd and the weight.
//!
//! [`add_layer_norm`] (`ember_core::fused::add_layer_norm`) fuses the residual add before a
//! layer norm (GPT-2's `x + proj(..)` then `ln2`): one kernel writes the sum and the normalized
//! rows; its graph is the two ops' nodes, so backward is LayerNorm's one kernel adding its dx to
//! the sum's other gradient.

use crate::autograd::{self, SavedTensor};
use crate::backend::LayerNormGrads;
use crate::dispatch::{self, policy, Door};
use crate::storage::Storage;
use crate::{DType, Error, Result, Shape, Tensor};

const OP: &str = "layer_norm";
/// The autograd node of the fused residual add's sum (the op it stands for).
const ADD: &str = "add";

/// The parameters' dtype allowed with an input of dtype `x`: the same, or f32 for half inputs.
fn param_ok(x: DType, p: DType) -> bool {
    p == x || (p == DType::F32 && matches!(x, DType::F16 | DType::BF16))
}

impl Tensor {
    /// Layer normalization over the last `normalized_shape.len()` dims, which must equal
    /// `normalized_shape`: `(x - mean) / √(var + eps) · weight + bias` per row, with the biased
    /// variance and optional elementwise `weight` and `bias` of shape `normalized_shape`
    /// (`torch.nn.functional.layer_norm`). One fused kernel each way.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        dispatch::composite_list_kernel(&policy::LAYER_NORM, &[Some(self), weight, bias], |ins, door| {
            let [Some(x), w, b] = ins else {
                return Err(Error::invalid(OP, "the input is missing"));
            };
            layer_norm_prepared(x, normalized_shape, w.as_ref(), b.as_ref(), eps, door)
        })
    }
}

/// The fused residual add (llm.c's `fused_residual_forward`; `ember_core::fused`): returns
/// `(sum, normed)` with `sum = x + residual` and `normed = sum.layer_norm(normalized_shape,
/// weight, bias, eps)`, differentiable in all four, as the two ops give them (their dtypes,
/// autocast and promotion included), in one kernel forward where it can: it reads x and the
/// residual once and writes the sum, the normalized rows and their statistics (Note [Fused
/// residual add] in `kernels/norm.cu`).
///
/// The sum is rounded to its dtype before it is normalized, as `add` then `layer_norm` round
/// it, so the fused results are the composition's, bit for bit, on the CPU; on CUDA too when the
/// rows are read as 16-byte vectors in both (n a multiple of 16 bytes, x, the residual, weight
/// and bias 16-byte aligned, as tensors from the allocator are), else within an ulp or so of
/// the output dtype (one sum order against another).
///
/// Backward is the two ops' nodes (the sum's is `add`'s, the normed output's `layer_norm`'s):
/// LayerNorm's backward kernel adds its dx to the gradient that reached the sum from its other
/// uses, when that one is already waiting (Note [Gradients added in place] in
/// `autograd/engine.rs`; with none, it is zero), and the sum's gradient is then x's and the
/// residual's (each in its dtype). One kernel for the sum's gradient, and, with weight or bias,
/// the parameters' partial sums in it and one small kernel adding them in order.
///
/// Fused when x and the residual have one shape and one float dtype, or on CUDA are a float32
/// tensor beside a float16/bfloat16 one (the sum float32, as `add` reads such a pair), and the
/// parameters fit the layer norm of the sum (under autocast: a float32 sum and parameters,
/// since `layer_norm` runs in float32 there). Anything else (broadcasting, promotion, a half
/// sum under autocast) runs `add` then `layer_norm`, with their results and errors.
pub fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let mut inputs = vec![x, residual];
    inputs.extend(weight);
    inputs.extend(bias);
    dispatch::named_kernel(&policy::ADD_LAYER_NORM, &inputs, |door| {
        let Some(sum_dtype) = fused_sum_dtype(x, residual, weight, bias) else {
            let sum = x.add(residual)?;
            let normed = sum.layer_norm(normalized_shape, weight, bias, eps)?;
            return Ok((sum, normed));
        };
        check(x, normalized_shape, weight, bias)?;
        // The kernel reads the float32 operand of a mixed pair as x (the sum is the same bits
        // either way round).
        let (a, b) = if x.dtype() == sum_dtype {
            (x, residual)
        } else {
            (residual, x)
        };
        let (ac, bc) = (a.contiguous()?, b.contiguous()?);
        let wc = weight.map(Tensor::contiguous).transpose()?;
        let bic = bias.map(Tensor::contiguous).transpose()?;
        let n: usize = normalized_shape.iter().product();
        let twin = twin_for(&ac);
        let (sum, (y, mean, rstd, y_twin)) = {
            let (xs, rs) = (ac.storage().read(), bc.storage().read());
            let ws = wc.as_ref().map(|t| t.storage().read());
            let bs = bic.as_ref().map(|t| t.storage().read());
            let w = ws.as_deref().zip(wc.as_ref().map(Tensor::layout));
            let b = bs.as_deref().zip(bic.as_ref().map(Tensor::layout));
            xs.add_layer_norm(ac.layout(), (&rs, bc.layout()), w, b, n, eps, twin)?
        };
        let sum = door.tensor(sum, x.shape().clone());
        let sum = if autograd::needs_grad(&[x, residual]) {
            let (xd, rd) = (x.dtype(), residual.dtype());
            door.record(ADD, &[x, residual], sum, move |g: &Tensor, needs: &[bool]| {
                // `add`'s backward: the gradient itself for each, in its input's dtype.
                let each = |need: bool, d: DType| -> Result<Option<Tensor>> {
                    match need {
                        false => Ok(None),
                        true if g.dtype() == d => Ok(Some(g.clone())),
                        true => g.to_dtype(d).map(Some),
                    }
                };
                Ok(vec![each(needs[0], xd)?, each(needs[1], rd)?])
            })
        } else {
            sum
        };
        let y = door.tensor(y, x.shape().clone());
        if let Some(t) = y_twin {
            y.storage().set_twin(t, true);
        }
        let norm = Normed {
            x: &sum,
            xc: &sum,
            weight,
            bias,
            wc,
            normalized_shape,
            mean,
            rstd,
            twin,
        };
        let normed = norm.record(y, door);
        Ok((sum, normed))
    })
}

/// The sum's dtype when `add_layer_norm` runs its fused kernel for these operands, or `None`
/// where it runs `add` then `layer_norm` (see there).
fn fused_sum_dtype(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Option<DType> {
    let half = |d: DType| matches!(d, DType::F16 | DType::BF16);
    let (xd, rd) = (x.dtype(), residual.dtype());
    let sum = match (xd, rd) {
        _ if x.shape() != residual.shape() || !xd.is_floating_point() => return None,
        (a, b) if a == b => a,
        // `add` reads such a pair on CUDA without casting (Promotion::CommonMixed).
        (DType::F32, b) if half(b) && x.device().is_cuda() => DType::F32,
        (a, DType::F32) if half(a) && x.device().is_cuda() => DType::F32,
        _ => return None,
    };
    let mut params = weight.iter().chain(bias.iter()).map(|t| t.dtype());
    let autocast = crate::amp::is_autocast_enabled(x.device().device_type());
    let params_fit = if autocast {
        // `layer_norm` under autocast runs its input and parameters in float32: fused when no
        // cast is needed.
        sum == DType::F32 && params.all(|p| p == DType::F32)
    } else {
        params.all(|p| param_ok(sum, p))
    };
    let one_param_dtype = match (weight, bias) {
        (Some(w), Some(b)) => w.dtype() == b.dtype(),
        _ => true,
    };
    (params_fit && one_param_dtype).then_some(sum)
}

fn check(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<()> {
    let k = normalized_shape.len();
    if k == 0 || x.rank() < k || &x.dims()[x.rank() - k..] != normalized_shape {
        return Err(Error::invalid(
            OP,
            format!(
                "normalized_shape {normalized_shape:?} must be non-empty and equal the last dims of the input, got input shape {}",
                x.shape()
            ),
        ));
    }
    if !x.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: x.dtype(),
            hint: "it needs a floating point input; convert with .to_dtype(DType::F32) first",
        });
    }
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            if t.dims() != normalized_shape {
                return Err(Error::invalid(
                    OP,
                    format!("{name} must have shape {normalized_shape:?}, got {}", t.shape()),
                ));
            }
            if !param_ok(x.dtype(), t.dtype()) {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: x.dtype(),
                    found: t.dtype(),
                });
            }
        }
    }
    if let (Some(w), Some(b)) = (weight, bias) {
        if w.dtype() != b.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: w.dtype(),
                found: b.dtype(),
            });
        }
    }
    Ok(())
}

/// Under bf16 autocast the float32 output and the input's gradient are cast to bf16 next (by
/// the linear after the norm; by the bf16 branch the residual stream feeds), so the kernels
/// write those casts beside them (Note [Cast twins] in `storage/mod.rs`).
fn twin_for(x: &Tensor) -> Option<DType> {
    (x.dtype() == DType::F32
        && crate::amp::is_autocast_enabled(x.device().device_type())
        && crate::amp::get_autocast_dtype(x.device().device_type()) == DType::BF16)
        .then_some(DType::BF16)
}

fn layer_norm_prepared(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    door: Door,
) -> Result<Tensor> {
    check(x, normalized_shape, weight, bias)?;
    // The kernels read contiguous rows (as PyTorch's `X.expect_contiguous()`).
    let xc = x.contiguous()?;
    let wc = weight.map(Tensor::contiguous).transpose()?;
    let bc = bias.map(Tensor::contiguous).transpose()?;
    let n: usize = normalized_shape.iter().product();
    let twin = twin_for(x);
    let (y, mean, rstd, y_twin) = {
        let xs = xc.storage().read();
        let ws = wc.as_ref().map(|t| t.storage().read());
        let bs = bc.as_ref().map(|t| t.storage().read());
        let w = ws.as_deref().zip(wc.as_ref().map(Tensor::layout));
        let b = bs.as_deref().zip(bc.as_ref().map(Tensor::layout));
        xs.layer_norm(xc.layout(), w, b, n, eps, twin)?
    };
    let y = door.tensor(y, x.shape().clone());
    if let Some(t) = y_twin {
        y.storage().set_twin(t, true);
    }
    let norm = Normed {
        x,
        xc: &xc,
        weight,
        bias,
        wc,
        normalized_shape,
        mean,
        rstd,
        twin,
    };
    Ok(norm.record(y, door))
}

/// A layer norm's forward results and what its node needs: `x` is the input the graph sees,
/// `xc` its contiguous elements (saved), `wc` the contiguous weight.
struct Normed<'a> {
    x: &'a Tensor,
    xc: &'a Tensor,
    weight: Option<&'a Tensor>,
    bias: Option<&'a Tensor>,
    wc: Option<Tensor>,
    normalized_shape: &'a [usize],
    mean: Storage,
    rstd: Storage,
    twin: Option<DType>,
}

impl Normed<'_> {
    /// Records the layer norm's node on its output `y` (when an input needs a gradient): one
    /// backward kernel for the input's gradient (added to the one already waiting for the
    /// input, when the engine offers it) and the parameters' partial sums, and one adding those.
    fn record(self, y: Tensor, door: Door) -> Tensor {
        let Normed {
            x,
            xc,
            weight,
            bias,
            wc,
            normalized_shape,
            mean,
            rstd,
            twin,
        } = self;
        let mut inputs: Vec<&Tensor> = vec![x];
        inputs.extend(weight);
        inputs.extend(bias);
        if !autograd::needs_grad(&inputs) {
            return y;
        }
        let n: usize = normalized_shape.iter().product();
        let rows = x.numel().checked_div(n).unwrap_or(0);
        let mean = door.tensor(mean, Shape::from([rows]));
        let rstd = door.tensor(rstd, Shape::from([rows]));
        let saved_x = SavedTensor::new(OP, xc);
        let saved_w = wc.as_ref().map(|w| SavedTensor::new(OP, w));
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        let (w_dtype, b_dtype) = (weight.map(Tensor::dtype), bias.map(Tensor::dtype));
        let x_shape = x.shape().clone();
        let param_shape: Vec<isize> = normalized_shape.iter().map(|&d| d as isize).collect();
        let y = door.record(OP, &inputs, y, move |g: &Tensor, needs: &[bool]| {
            let x = saved_x.get()?;
            let w = saved_w.as_ref().map(SavedTensor::get).transpose()?;
            dispatch::check_devices(OP, &[x, g])?;
            let g = g.to_dtype(x.dtype())?.contiguous()?;
            let want = LayerNormGrads {
                input: needs[0],
                weight: w_dtype.filter(|_| has_w && needs[1]),
                bias: b_dtype.filter(|_| has_b && needs[1 + has_w as usize]),
            };
            // Note [Gradients added in place] in `autograd/engine.rs`: dx is added to the
            // gradient already waiting for x (the residual stream's) when the engine offers
            // it: into it when nothing else holds it, else into a new buffer, in the kernel
            // that computes dx either way.
            let offered = want.input.then(|| {
                autograd::take_addend(|t| {
                    t.dtype() == x.dtype()
                        && t.shape() == &x_shape
                        && t.layout().is_contiguous()
                        && t.layout().offset() == 0
                        && t.device() == x.device()
                })
            });
            let (into, addend) = match offered.flatten() {
                Some((t, true)) => (Some(t), None),
                Some((t, false)) => (None, Some(t)),
                None => (None, None),
            };
            let [dx, dw, db, dx_twin] = {
                let (gs, xs) = (g.storage().read(), x.storage().read());
                let (ms, rs) = (mean.storage().read(), rstd.storage().read());
                let ws = w.map(|t| t.storage().read());
                let wl = w.map(Tensor::layout);
                let mut acc = into.as_ref().map(|t| t.storage().write());
                let add = addend.as_ref().map(|t| t.storage().read());
                gs.layer_norm_backward(
                    g.layout(),
                    (&xs, x.layout()),
                    &ms,
                    &rs,
                    ws.as_deref().zip(wl),
                    n,
                    want,
                    acc.as_deref_mut(),
                    add.as_deref(),
                    twin,
                )?
            };
            let dx = match into {
                Some(sum) => Some(sum),
                None => dx.map(|s| door.tensor(s, x_shape.clone())),
            };
            if let (Some(dx), Some(t)) = (&dx, dx_twin) {
                dx.storage().set_twin(t, true);
            }
            let param = |s: Option<Storage>| -> Result<Option<Tensor>> {
                s.map(|s| door.tensor(s, Shape::from([n])).reshape(&param_shape))
                    .transpose()
            };
            let mut grads = vec![dx];
            if has_w {
                grads.push(param(dw)?);
            }
            if has_b {
                grads.push(param(db)?);
            }
            Ok(grads)
        });
        autograd::mark_accumulating(&y);
        y
    }
}
