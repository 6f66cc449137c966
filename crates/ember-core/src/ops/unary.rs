//! Elementwise ops of one tensor: math functions and activations, with backward rules.
//!
//! Every op goes through one path (`unary`): the result dtype ([`UnaryOp::result_dtype`],
//! PyTorch's rules), the backend kernel, then the autograd record. The backward rules sit in one
//! table (`grad_rule`) written with tensor ops, so they run on every device.
//!
//! Note [Unary dtypes]: float inputs keep their dtype. Sign-preserving integer ops (neg, abs,
//! sign, relu, square, and floor/ceil/round/trunc, which return a copy) keep integer dtypes;
//! every other op computes integer or bool inputs in float32, as PyTorch's "float" unary ops do.
//! Bool inputs: abs and sign return them unchanged, square gives int64, and neg, relu and the
//! rounding ops are errors.

use crate::autograd::SavedTensor;
use crate::backend::table::unary_table;
use crate::dispatch::{self, policy, Door};
use crate::{Error, Result, Tensor};
use std::f64::consts::{FRAC_2_SQRT_PI, LN_10, LN_2, PI};

/// `α` of SELU (Klambauer et al., 2017), as PyTorch.
pub const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
/// `λ` (scale) of SELU, as PyTorch.
pub const SELU_SCALE: f64 = 1.050_700_987_355_480_5;
pub use crate::backend::op::{UnaryOp, GELU_TANH_KAPPA};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Saves {
    Input,
    Output,
    Nothing,
}

/// A method per op without parameters, and each op's backward: the unary table
/// (`backend/table.rs`) expanded in the op layer.
macro_rules! unary_ops {
    ($( ($v:ident $({ $($f:ident),* })? $([ $($p:expr),* ])?, $stem:ident $(as $bin:ident)?,
         $cast:ident, $ints:ident, $saves:ident) |$g:ident, $s:ident $(, $d:ident)?| $rule:expr, $doc:literal; )*) => {
        $(unary_method!([$({ $($f),* })?] $v, $stem, $doc);)*

        /// Whether backward needs the op's input, its output, or neither.
        fn saves(op: UnaryOp) -> Saves {
            match op {
                $(UnaryOp::$v { .. } => Saves::$saves,)*
            }
        }

        /// The gradient of `op` given the output gradient `g` and the saved tensor (its input
        /// or output, see [`saves`]), with PyTorch's conventions at kinks: abs'(0) = 0,
        /// relu'(0) = 0, leaky_relu'(0) = slope, and zero gradient for sign and the rounding
        /// ops.
        #[allow(unused_variables)]
        fn grad_rule(op: UnaryOp, g: &Tensor, saved: Option<&Tensor>, door: Door) -> Result<Tensor> {
            let saved = || saved.ok_or_else(|| Error::Autograd(format!("{} saved no tensor", op.name())));
            Ok(match op {
                $(UnaryOp::$v { $($($f),*)? } => {
                    let ($g, $s) = (g, saved);
                    $(let $d = door;)?
                    $rule
                })*
            })
        }
    };
}

/// The `Tensor` method of an op without parameters (parametrized ones are written below).
macro_rules! unary_method {
    ([] $v:ident, $stem:ident, $doc:literal) => {
        impl Tensor {
            #[doc = $doc]
            pub fn $stem(&self) -> Result<Tensor> {
                unary(UnaryOp::$v, self)
            }
        }
    };
    ([$($fields:tt)+] $v:ident, $stem:ident, $doc:literal) => {};
}

unary_table!(unary_ops);

/// `op(x)` with PyTorch's dtype rules and autograd, through the dispatch point.
pub(crate) fn unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    let out = unary_recorded(op, x)?;
    if op == UnaryOp::GeluTanh && out.dtype() == x.dtype() {
        // A product whose output this is may apply its gradient (Note [Activation epilogues]).
        crate::autograd::mark_activation(&out, crate::autograd::Activation::GeluTanh, x);
    }
    Ok(out)
}

fn unary_recorded(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    dispatch::call(
        op.line(),
        [x],
        |[x], door| {
            let dtype = op.result_dtype(x.dtype())?;
            let storage = x.storage().read().unary(op, x.layout())?;
            debug_assert_eq!(
                storage.dtype(),
                dtype,
                "{} kernel produced the wrong dtype",
                op.name()
            );
            Ok(door.tensor(storage, x.shape()))
        },
        |[x], out, door| {
            let saved = match saves(op) {
                Saves::Input => Some(SavedTensor::new(op.name(), x)),
                Saves::Output => Some(SavedTensor::new(op.name(), out)),
                Saves::Nothing => None,
            };
            Ok(move |g: &Tensor, _: &[bool]| {
                let saved = saved.as_ref().map(|s| s.get()).transpose()?;
                Ok(vec![Some(grad_rule(op, g, saved, door)?)])
            })
        },
    )
}

/// ReLU's input gradient from its output `y` (PyTorch's `threshold_backward`): the backend's
/// one-kernel rule where it has one and both operands are plain contiguous buffers of one dtype
/// (cuDNN's activation backward), else a select.
fn relu_backward(g: &Tensor, y: &Tensor, door: Door) -> Result<Tensor> {
    let plain = |t: &Tensor| t.is_contiguous() && t.storage_offset() == 0;
    if !crate::autograd::is_grad_enabled()
        && g.dtype() == y.dtype()
        && g.dims() == y.dims()
        && plain(g)
        && plain(y)
    {
        let dx = y.storage().read().relu_backward(&g.storage().read(), g.numel())?;
        if let Some(dx) = dx {
            return Ok(door.tensor(dx, g.shape().clone()));
        }
    }
    let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
    Tensor::where_cond(&y.gt_scalar(0.0)?, g, &zero)
}

/// ELU's input gradient (SELU and CELU too) from the input `x`.
fn elu_backward(g: &Tensor, x: &Tensor, alpha: f64, scale: f64, input_scale: f64) -> Result<Tensor> {
    let neg = g
        .mul(&x.mul_scalar(input_scale)?.exp()?)?
        .mul_scalar(alpha * scale * input_scale)?;
    Tensor::where_cond(&x.le_scalar(0.0)?, &neg, &g.mul_scalar(scale)?)
}

/// `g` where `inside`, else 0 (one zero, broadcast by the select: no zeros tensor is filled).
fn pass_inside(g: &Tensor, inside: &Tensor) -> Result<Tensor> {
    Tensor::where_cond(inside, g, &Tensor::scalar(0.0, g.dtype(), g.device())?)
}

/// 0 below -3, x/3 + 1/2 on [-3, 3], 1 above (PyTorch's hardswish_backward).
fn hardswish_backward(g: &Tensor, x: &Tensor) -> Result<Tensor> {
    let mid = g.mul(&x.mul_scalar(1.0 / 3.0)?.add_scalar(0.5)?)?;
    let upper = Tensor::where_cond(&x.le_scalar(3.0)?, &mid, g)?;
    let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
    Tensor::where_cond(&x.lt_scalar(-3.0)?, &zero, &upper)
}

/// GELU's backward: one kernel (the binary table's `gelu_backward`), fp32 inside.
fn gelu_backward(g: &Tensor, x: &Tensor) -> Result<Tensor> {
    g.gelu_backward(x)
}

/// The tanh form's backward: one kernel (`gelu_tanh_backward`), fp32 inside.
fn gelu_tanh_backward(g: &Tensor, x: &Tensor) -> Result<Tensor> {
    g.gelu_tanh_backward(x)
}

/// `√(1 - x²)`, the denominator of asin' and acos'.
fn one_minus_square_sqrt(x: &Tensor) -> Result<Tensor> {
    x.square()?.neg()?.add_scalar(1.0)?.sqrt()
}

impl Tensor {
    /// Elementwise `min(max(x, 0), 6)`.
    pub fn relu6(&self) -> Result<Tensor> {
        dispatch::named(&policy::RELU6, &[self], || {
            unary(UnaryOp::Hardtanh { min: 0.0, max: 6.0 }, self)
        })
    }

    /// Elementwise SELU.
    pub fn selu(&self) -> Result<Tensor> {
        let op = UnaryOp::Elu {
            alpha: SELU_ALPHA,
            scale: SELU_SCALE,
            input_scale: 1.0,
        };
        dispatch::named(&policy::SELU, &[self], || unary(op, self))
    }
}

impl Tensor {
    /// Elementwise `log(1 + eˣ)` with PyTorch's defaults `beta = 1`, `threshold = 20`.
    pub fn softplus(&self) -> Result<Tensor> {
        self.softplus_with(1.0, 20.0)
    }

    /// Elementwise `log(1 + e^(βx)) / β`, or `x` where `βx > threshold` (`F.softplus`).
    pub fn softplus_with(&self, beta: f64, threshold: f64) -> Result<Tensor> {
        if beta == 0.0 || beta.is_nan() {
            return Err(Error::invalid(
                "softplus",
                format!("beta must be nonzero, got {beta}"),
            ));
        }
        unary(UnaryOp::Softplus { beta, threshold }, self)
    }

    /// Elementwise `x > 0 ? x : negative_slope · x` (`F.leaky_relu`; PyTorch's default slope is 0.01).
    pub fn leaky_relu(&self, negative_slope: f64) -> Result<Tensor> {
        unary(UnaryOp::LeakyRelu { negative_slope }, self)
    }

    /// Elementwise ELU `x > 0 ? x : α(eˣ - 1)` (`F.elu`; PyTorch's default α is 1).
    pub fn elu(&self, alpha: f64) -> Result<Tensor> {
        unary(
            UnaryOp::Elu {
                alpha,
                scale: 1.0,
                input_scale: 1.0,
            },
            self,
        )
    }

    /// Elementwise CELU `max(0, x) + min(0, α(e^(x/α) - 1))` (`F.celu`).
    pub fn celu(&self, alpha: f64) -> Result<Tensor> {
        if alpha == 0.0 {
            return Err(Error::invalid("celu", "alpha cannot be 0 for CELU"));
        }
        let op = UnaryOp::Elu {
            alpha,
            scale: 1.0,
            input_scale: 1.0 / alpha,
        };
        dispatch::named(&policy::CELU, &[self], || unary(op, self))
    }

    /// Elementwise clamp to `[min_val, max_val]` with hardtanh's gradient (`F.hardtanh`;
    /// PyTorch's defaults are -1 and 1).
    pub fn hardtanh(&self, min_val: f64, max_val: f64) -> Result<Tensor> {
        if min_val > max_val || min_val.is_nan() || max_val.is_nan() {
            return Err(Error::invalid(
                "hardtanh",
                format!("min_val ({min_val}) must not be greater than max_val ({max_val})"),
            ));
        }
        unary(
            UnaryOp::Hardtanh {
                min: min_val,
                max: max_val,
            },
            self,
        )
    }

    /// `op` applied elementwise: the generic entry point behind the named methods.
    pub fn unary_op(&self, op: UnaryOp) -> Result<Tensor> {
        unary(op, self)
    }
}
