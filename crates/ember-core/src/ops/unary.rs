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
use crate::dispatch::{self, policy, Op};
use crate::{Error, Result, Tensor};
use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, LN_10, LN_2, PI};

/// `α` of SELU (Klambauer et al., 2017), as PyTorch.
pub const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
/// `λ` (scale) of SELU, as PyTorch.
pub const SELU_SCALE: f64 = 1.050_700_987_355_480_5;
pub use crate::backend::op::{UnaryOp, GELU_TANH_KAPPA};

impl UnaryOp {
    /// Whether backward needs the op's input, its output, or neither.
    fn saves(self) -> Saves {
        use UnaryOp::*;
        match self {
            Neg | Sign | Floor | Ceil | Round | Trunc => Saves::Nothing,
            AddScalar { .. } | SubScalar { .. } | MulScalar { .. } | DivScalar { .. } => Saves::Nothing,
            Exp | Exp2 | Expm1 | Sqrt | Rsqrt | Tan | Tanh | Sigmoid | Relu | Reciprocal => Saves::Output,
            _ => Saves::Input,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Saves {
    Input,
    Output,
    Nothing,
}

/// The op table's line for `op`.
fn line(op: UnaryOp) -> &'static Op {
    use UnaryOp::*;
    match op {
        Neg => &policy::NEG,
        Abs => &policy::ABS,
        Sign => &policy::SIGN,
        Square => &policy::SQUARE,
        Reciprocal => &policy::RECIPROCAL,
        Sqrt => &policy::SQRT,
        Rsqrt => &policy::RSQRT,
        Exp => &policy::EXP,
        Exp2 => &policy::EXP2,
        Expm1 => &policy::EXPM1,
        Log => &policy::LOG,
        Log2 => &policy::LOG2,
        Log10 => &policy::LOG10,
        Log1p => &policy::LOG1P,
        Sin => &policy::SIN,
        Cos => &policy::COS,
        Tan => &policy::TAN,
        Asin => &policy::ASIN,
        Acos => &policy::ACOS,
        Atan => &policy::ATAN,
        Sinh => &policy::SINH,
        Cosh => &policy::COSH,
        Tanh => &policy::TANH,
        Erf => &policy::ERF,
        Erfc => &policy::ERFC,
        Floor => &policy::FLOOR,
        Ceil => &policy::CEIL,
        Round => &policy::ROUND,
        Trunc => &policy::TRUNC,
        Sigmoid => &policy::SIGMOID,
        LogSigmoid => &policy::LOGSIGMOID,
        Relu => &policy::RELU,
        LeakyRelu { .. } => &policy::LEAKY_RELU,
        Elu { .. } => &policy::ELU,
        Hardtanh { .. } => &policy::HARDTANH,
        Hardsigmoid => &policy::HARDSIGMOID,
        Hardswish => &policy::HARDSWISH,
        Gelu => &policy::GELU,
        GeluTanh => &policy::GELU_TANH,
        Silu => &policy::SILU,
        Mish => &policy::MISH,
        Softplus { .. } => &policy::SOFTPLUS,
        Softsign => &policy::SOFTSIGN,
        AddScalar { .. } => &policy::ADD,
        SubScalar { .. } => &policy::SUB,
        MulScalar { .. } => &policy::MUL,
        DivScalar { .. } => &policy::DIV,
    }
}

/// `op(x)` with PyTorch's dtype rules and autograd, through the dispatch point.
pub(crate) fn unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    dispatch::call(
        line(op),
        [x],
        |[x]| {
            let dtype = op.result_dtype(x.dtype())?;
            let storage = x.storage().read().unary(op, x.layout())?;
            debug_assert_eq!(
                storage.dtype(),
                dtype,
                "{} kernel produced the wrong dtype",
                op.name()
            );
            Ok(Tensor::from_storage(storage, x.shape()))
        },
        |[x], out| {
            let saved = match op.saves() {
                Saves::Input => Some(SavedTensor::new(op.name(), x)),
                Saves::Output => Some(SavedTensor::new(op.name(), out)),
                Saves::Nothing => None,
            };
            Ok(move |g: &Tensor, _: &[bool]| {
                let saved = saved.as_ref().map(|s| s.get()).transpose()?;
                Ok(vec![Some(grad_rule(op, g, saved)?)])
            })
        },
    )
}

/// The gradient of `op` at the saved tensor `s` (its input or output, see [`UnaryOp::saves`])
/// given the output gradient `g`, with PyTorch's conventions at kinks: abs'(0) = 0,
/// relu'(0) = 0, leaky_relu'(0) = slope, and zero gradient for sign and the rounding ops.
/// ReLU's input gradient from its output `y` (PyTorch's `threshold_backward`): the backend's
/// one-kernel rule where it has one and both operands are plain contiguous buffers of one dtype
/// (cuDNN's activation backward), else a select.
fn relu_backward(g: &Tensor, y: &Tensor) -> Result<Tensor> {
    let plain = |t: &Tensor| t.is_contiguous() && t.storage_offset() == 0;
    if !crate::autograd::is_grad_enabled()
        && g.dtype() == y.dtype()
        && g.dims() == y.dims()
        && plain(g)
        && plain(y)
    {
        let dx = y.storage().read().relu_backward(&g.storage().read(), g.numel())?;
        if let Some(dx) = dx {
            return Ok(Tensor::from_storage(dx, g.shape().clone()));
        }
    }
    let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
    Tensor::where_cond(&y.gt_scalar(0.0)?, g, &zero)
}

fn grad_rule(op: UnaryOp, g: &Tensor, s: Option<&Tensor>) -> Result<Tensor> {
    use UnaryOp::*;
    let s = || s.ok_or_else(|| Error::Autograd(format!("{} saved no tensor", op.name())));
    let zeros = || g.zeros_like();
    // The zero a `where` selects: one element, broadcast, so the select reads no zeros tensor
    // (and none is filled) beside the gradient.
    let zero = || Tensor::scalar(0.0, g.dtype(), g.device());
    Ok(match op {
        Neg => g.neg()?,
        Sign | Floor | Ceil | Round | Trunc => zeros()?,
        Abs => g.mul(&s()?.sign()?)?,
        Square => g.mul(s()?)?.mul_scalar(2.0)?,
        // y = 1/x: dy/dx = -y².
        Reciprocal => g.mul(&s()?.square()?)?.neg()?,
        Sqrt => g.div(&s()?.mul_scalar(2.0)?)?,
        // y = x^(-1/2): dy/dx = -y³/2.
        Rsqrt => g.mul(&s()?.square()?.mul(s()?)?)?.mul_scalar(-0.5)?,
        Exp => g.mul(s()?)?,
        Exp2 => g.mul(s()?)?.mul_scalar(LN_2)?,
        Expm1 => g.mul(&s()?.add_scalar(1.0)?)?,
        Log => g.div(s()?)?,
        Log2 => g.div(&s()?.mul_scalar(LN_2)?)?,
        Log10 => g.div(&s()?.mul_scalar(LN_10)?)?,
        Log1p => g.div(&s()?.add_scalar(1.0)?)?,
        Sin => g.mul(&s()?.cos()?)?,
        Cos => g.mul(&s()?.sin()?)?.neg()?,
        Tan => g.mul(&s()?.square()?.add_scalar(1.0)?)?,
        Asin => g.div(&one_minus_square_sqrt(s()?)?)?,
        Acos => g.div(&one_minus_square_sqrt(s()?)?)?.neg()?,
        Atan => g.div(&s()?.square()?.add_scalar(1.0)?)?,
        Sinh => g.mul(&s()?.cosh()?)?,
        Cosh => g.mul(&s()?.sinh()?)?,
        Tanh => g.mul(&s()?.square()?.neg()?.add_scalar(1.0)?)?,
        Erf => g.mul(&s()?.square()?.neg()?.exp()?)?.mul_scalar(FRAC_2_SQRT_PI)?,
        Erfc => g
            .mul(&s()?.square()?.neg()?.exp()?)?
            .mul_scalar(-FRAC_2_SQRT_PI)?,
        Sigmoid => {
            let y = s()?;
            g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)?
        }
        // d/dx log σ(x) = σ(-x).
        LogSigmoid => g.mul(&s()?.neg()?.sigmoid()?)?,
        // Saves the output: y > 0 exactly where x > 0 (PyTorch's threshold_backward).
        Relu => relu_backward(g, s()?)?,
        LeakyRelu { negative_slope } => {
            Tensor::where_cond(&s()?.gt_scalar(0.0)?, g, &g.mul_scalar(negative_slope)?)?
        }
        Elu {
            alpha,
            scale,
            input_scale,
        } => {
            let x = s()?;
            let neg = g
                .mul(&x.mul_scalar(input_scale)?.exp()?)?
                .mul_scalar(alpha * scale * input_scale)?;
            Tensor::where_cond(&x.le_scalar(0.0)?, &neg, &g.mul_scalar(scale)?)?
        }
        Hardtanh { min, max } => {
            let x = s()?;
            let inside = x.gt_scalar(min)?.logical_and(&x.lt_scalar(max)?)?;
            Tensor::where_cond(&inside, g, &zero()?)?
        }
        Hardsigmoid => {
            let x = s()?;
            let inside = x.gt_scalar(-3.0)?.logical_and(&x.lt_scalar(3.0)?)?;
            Tensor::where_cond(&inside, &g.mul_scalar(1.0 / 6.0)?, &zero()?)?
        }
        Hardswish => {
            // 0 below -3, x/3 + 1/2 on [-3, 3], 1 above (PyTorch's hardswish_backward).
            let x = s()?;
            let mid = g.mul(&x.mul_scalar(1.0 / 3.0)?.add_scalar(0.5)?)?;
            let upper = Tensor::where_cond(&x.le_scalar(3.0)?, &mid, g)?;
            Tensor::where_cond(&x.lt_scalar(-3.0)?, &zero()?, &upper)?
        }
        Gelu => {
            // Φ(x) + x φ(x), φ(x) = exp(-x²/2) / √(2π).
            let x = s()?;
            let cdf = x
                .mul_scalar(FRAC_1_SQRT_2)?
                .erf()?
                .add_scalar(1.0)?
                .mul_scalar(0.5)?;
            let pdf = x
                .square()?
                .mul_scalar(-0.5)?
                .exp()?
                .mul_scalar(1.0 / (2.0 * PI).sqrt())?;
            g.mul(&cdf.add(&x.mul(&pdf)?)?)?
        }
        GeluTanh => {
            // With u = k(x + κx³), t = tanh u: 0.5(1 + t) + 0.5x(1 - t²) k(1 + 3κx²).
            let x = s()?;
            let k = (2.0 / PI).sqrt();
            let x2 = x.square()?;
            let t = x2
                .mul_scalar(GELU_TANH_KAPPA)?
                .add_scalar(1.0)?
                .mul(x)?
                .mul_scalar(k)?
                .tanh()?;
            let left = t.add_scalar(1.0)?.mul_scalar(0.5)?;
            let du = x2
                .mul_scalar(3.0 * GELU_TANH_KAPPA)?
                .add_scalar(1.0)?
                .mul_scalar(k)?;
            let right = x
                .mul_scalar(0.5)?
                .mul(&t.square()?.neg()?.add_scalar(1.0)?)?
                .mul(&du)?;
            g.mul(&left.add(&right)?)?
        }
        Silu => {
            // σ(x) (1 + x (1 - σ(x))).
            let x = s()?;
            let sig = x.sigmoid()?;
            let inner = x.mul(&sig.neg()?.add_scalar(1.0)?)?.add_scalar(1.0)?;
            g.mul(&sig.mul(&inner)?)?
        }
        Mish => {
            // tanh(sp) + x σ(x) (1 - tanh²(sp)), sp = log(1 + eˣ).
            let x = s()?;
            let t = x.softplus_with(1.0, f64::INFINITY)?.tanh()?;
            let right = x.mul(&x.sigmoid()?)?.mul(&t.square()?.neg()?.add_scalar(1.0)?)?;
            g.mul(&t.add(&right)?)?
        }
        Softplus { beta, threshold } => {
            let bx = s()?.mul_scalar(beta)?;
            Tensor::where_cond(&bx.gt_scalar(threshold)?, g, &g.mul(&bx.sigmoid()?)?)?
        }
        // 1 / (1 + |x|)².
        Softsign => g.div(&s()?.abs()?.add_scalar(1.0)?.square()?)?,
        AddScalar { .. } | SubScalar { .. } => g.clone(),
        MulScalar { value } => g.mul_scalar(value)?,
        DivScalar { value } => g.div_scalar(value)?,
    })
}

/// `√(1 - x²)`, the denominator of asin' and acos'.
fn one_minus_square_sqrt(x: &Tensor) -> Result<Tensor> {
    x.square()?.neg()?.add_scalar(1.0)?.sqrt()
}

macro_rules! unary_methods {
    ($($name:ident => $op:expr, $doc:literal;)*) => {
        impl Tensor {$(
            #[doc = $doc]
            pub fn $name(&self) -> Result<Tensor> {
                unary($op, self)
            }
        )*}
    };
}

unary_methods! {
    neg => UnaryOp::Neg, "Elementwise `-x` (integers wrap; an error for bool).";
    abs => UnaryOp::Abs, "Elementwise `|x|`.";
    sign => UnaryOp::Sign, "Elementwise sign: -1, 0 or 1 (0 for NaN, as PyTorch).";
    square => UnaryOp::Square, "Elementwise `x²` (bool gives int64).";
    reciprocal => UnaryOp::Reciprocal, "Elementwise `1 / x` (integers compute in float32).";
    sqrt => UnaryOp::Sqrt, "Elementwise square root.";
    rsqrt => UnaryOp::Rsqrt, "Elementwise `1 / √x`.";
    exp => UnaryOp::Exp, "Elementwise `eˣ`.";
    exp2 => UnaryOp::Exp2, "Elementwise `2ˣ`.";
    expm1 => UnaryOp::Expm1, "Elementwise `eˣ - 1`, accurate near 0.";
    log => UnaryOp::Log, "Elementwise natural logarithm.";
    log2 => UnaryOp::Log2, "Elementwise base-2 logarithm.";
    log10 => UnaryOp::Log10, "Elementwise base-10 logarithm.";
    log1p => UnaryOp::Log1p, "Elementwise `ln(1 + x)`, accurate near 0.";
    sin => UnaryOp::Sin, "Elementwise sine.";
    cos => UnaryOp::Cos, "Elementwise cosine.";
    tan => UnaryOp::Tan, "Elementwise tangent.";
    asin => UnaryOp::Asin, "Elementwise arcsine.";
    acos => UnaryOp::Acos, "Elementwise arccosine.";
    atan => UnaryOp::Atan, "Elementwise arctangent.";
    sinh => UnaryOp::Sinh, "Elementwise hyperbolic sine.";
    cosh => UnaryOp::Cosh, "Elementwise hyperbolic cosine.";
    tanh => UnaryOp::Tanh, "Elementwise hyperbolic tangent.";
    erf => UnaryOp::Erf, "Elementwise Gauss error function.";
    erfc => UnaryOp::Erfc, "Elementwise complementary error function `1 - erf(x)`.";
    floor => UnaryOp::Floor, "Elementwise floor (integers: a copy).";
    ceil => UnaryOp::Ceil, "Elementwise ceiling (integers: a copy).";
    round => UnaryOp::Round, "Elementwise rounding, half to even as `torch.round` (integers: a copy).";
    trunc => UnaryOp::Trunc, "Elementwise rounding toward zero (integers: a copy).";
    sigmoid => UnaryOp::Sigmoid, "Elementwise logistic `1 / (1 + e⁻ˣ)`.";
    logsigmoid => UnaryOp::LogSigmoid, "Elementwise `log σ(x)`, computed stably (`F.logsigmoid`).";
    relu => UnaryOp::Relu, "Elementwise `max(x, 0)` (NaN propagates; an error for bool).";
    relu6 => UnaryOp::Hardtanh { min: 0.0, max: 6.0 }, "Elementwise `min(max(x, 0), 6)`.";
    selu => UnaryOp::Elu { alpha: SELU_ALPHA, scale: SELU_SCALE, input_scale: 1.0 }, "Elementwise SELU.";
    hardsigmoid => UnaryOp::Hardsigmoid, "Elementwise `clamp(x / 6 + 1/2, 0, 1)`.";
    hardswish => UnaryOp::Hardswish, "Elementwise `x · hardsigmoid(x)`.";
    gelu => UnaryOp::Gelu, "Elementwise GELU `x Φ(x)` with the exact normal CDF (PyTorch's default).";
    gelu_tanh => UnaryOp::GeluTanh, "Elementwise GELU, tanh approximation (`approximate='tanh'`).";
    silu => UnaryOp::Silu, "Elementwise SiLU (swish) `x σ(x)`.";
    mish => UnaryOp::Mish, "Elementwise Mish `x tanh(softplus(x))`.";
    softsign => UnaryOp::Softsign, "Elementwise `x / (1 + |x|)`.";
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
        unary(
            UnaryOp::Elu {
                alpha,
                scale: 1.0,
                input_scale: 1.0 / alpha,
            },
            self,
        )
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
