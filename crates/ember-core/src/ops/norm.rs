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

use crate::autograd::{self, SavedTensor};
use crate::backend::LayerNormGrads;
use crate::dispatch::{self, policy, Door};
use crate::{DType, Error, Result, Shape, Tensor};

const OP: &str = "layer_norm";

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

fn layer_norm_prepared(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    door: Door,
) -> Result<Tensor> {
    check(x, normalized_shape, weight, bias)?;
    let n: usize = normalized_shape.iter().product();
    let rows = x.numel().checked_div(n).unwrap_or(0);
    // The kernels read contiguous rows (as PyTorch's `X.expect_contiguous()`).
    let xc = x.contiguous()?;
    let wc = weight.map(Tensor::contiguous).transpose()?;
    let bc = bias.map(Tensor::contiguous).transpose()?;
    // Note [Cast twins] in `storage/mod.rs`: under bf16 autocast the float32 output and the
    // input's gradient are cast to bf16 next (by the linear after the norm; by the bf16 branch
    // the residual stream feeds), so the kernels write those casts beside them.
    let twin = (x.dtype() == DType::F32
        && crate::amp::is_autocast_enabled(x.device().device_type())
        && crate::amp::get_autocast_dtype(x.device().device_type()) == DType::BF16)
        .then_some(DType::BF16);
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
    let mut inputs: Vec<&Tensor> = vec![x];
    inputs.extend(weight);
    inputs.extend(bias);
    if !autograd::needs_grad(&inputs) {
        return Ok(y);
    }
    let mean = door.tensor(mean, Shape::from([rows]));
    let rstd = door.tensor(rstd, Shape::from([rows]));
    let saved_x = SavedTensor::new(OP, &xc);
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
        // Note [Gradients added in place] in `autograd/engine.rs`: dx is added into the
        // gradient already waiting for x (the residual stream's) when the engine offers it.
        let into = want.input.then(|| {
            autograd::take_accumulator(|t| {
                t.dtype() == x.dtype()
                    && t.shape() == &x_shape
                    && t.layout().is_contiguous()
                    && t.layout().offset() == 0
                    && t.device() == x.device()
            })
        });
        let into = into.flatten();
        let [dx, dw, db, dx_twin] = {
            let (gs, xs) = (g.storage().read(), x.storage().read());
            let (ms, rs) = (mean.storage().read(), rstd.storage().read());
            let ws = w.map(|t| t.storage().read());
            let wl = w.map(Tensor::layout);
            let mut acc = into.as_ref().map(|t| t.storage().write());
            gs.layer_norm_backward(
                g.layout(),
                (&xs, x.layout()),
                &ms,
                &rs,
                ws.as_deref().zip(wl),
                n,
                want,
                acc.as_deref_mut(),
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
        let param = |s: Option<crate::storage::Storage>| -> Result<Option<Tensor>> {
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
    Ok(y)
}
